"""Suite-wide setup: this folder is on sys.path, so tests share tests/processes.py."""
