"""Naming rules, grouping and URL expansion from the WebDataset format spec."""

from __future__ import annotations

import pytest

from ember.shards import FormatError, expand_urls, group_samples, split_name

# the grouping tests run with the compiled grouper and with the pure-Python one
grouping = pytest.mark.usefixtures("implementation")


@pytest.mark.parametrize(
    "name, expected",
    [
        ("dir/c.seg.png", ("dir/c", "seg.png")),
        ("d.e.f.jpg", ("d", "e.f.jpg")),
        ("a.b/c.d", ("a.b/c", "d")),
        ("x/y/z.JPG", ("x/y/z", "jpg")),
        ("nodot", None),
        ("a.b/nodot", None),
        ("__meta__", None),
        ("dir/__index__", None),
    ],
)
def test_split_name_follows_spec(name, expected):
    assert split_name(name) == expected


def _members(*names):
    return [(n, n.encode(), i * 1024) for i, n in enumerate(names)]


@grouping
def test_consecutive_members_form_one_sample_and_repeated_key_starts_a_new_one():
    members = _members("a.jpg", "a.cls", "b.jpg", "a.txt", "__meta__", "README")
    out = list(group_samples(members, "u.tar"))
    assert [s["__key__"] for s in out] == ["a", "b", "a"]
    assert out[0] == {"__key__": "a", "__url__": "u.tar", "jpg": b"a.jpg", "cls": b"a.cls"}
    assert set(out[2]) == {"__key__", "__url__", "txt"}


@grouping
def test_duplicate_extension_in_one_sample_is_an_error_with_offset():
    with pytest.raises(FormatError, match=r"duplicate file name 'a\.JPG'") as info:
        list(group_samples(_members("a.jpg", "a.JPG"), "u.tar"))
    assert info.value.url == "u.tar" and info.value.offset == 1024


@grouping
def test_reserved_extension_is_rejected():
    with pytest.raises(FormatError, match="reserved"):
        list(group_samples(_members("a.jpg", "a.__key__"), "u.tar"))


@grouping
def test_incomplete_sample_is_not_yielded_when_members_fail():
    def members():
        yield "a.jpg", b"1", 0
        yield "b.jpg", b"2", 1024
        raise RuntimeError("truncated")

    got = []
    with pytest.raises(RuntimeError):
        for s in group_samples(members(), "u"):
            got.append(s["__key__"])
    assert got == ["a"]


def test_brace_ranges_keep_padding_and_multiply():
    assert expand_urls("s-{008..011}.tar") == ["s-008.tar", "s-009.tar", "s-010.tar", "s-011.tar"]
    assert expand_urls("{a,b}-{1..2}") == ["a-1", "a-2", "b-1", "b-2"]
    assert expand_urls(["x{0..1}", ["y", "z{5..5}"]]) == ["x0", "x1", "y", "z5"]
    assert len(expand_urls("train-{000000..001281}.tar")) == 1282
    assert expand_urls("train-{000000..001281}.tar")[-1] == "train-001281.tar"


@pytest.mark.parametrize("bad", ["a{1..2", "a}b", "a{b}c"])
def test_bad_brace_patterns_raise(bad):
    with pytest.raises(ValueError):
        expand_urls(bad)
