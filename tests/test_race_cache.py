"""The decode linears' race winners on disk (dschat.rollout.race_cache): a second process
reads what the first wrote; a stale, corrupt or foreign entry is ignored, never trusted."""
import json

import pytest
import torch

from dschat.rollout import race_cache
from dschat.rollout.kernels import linears
from dschat.rollout.race_cache import RaceCache

IDENTITY = {"gpu": "NVIDIA H200", "capability": "9.0", "sms": 132, "torch": "2.11.0", "cuda": "13.0",
            "triton": "3.6.0", "kernels": "0123456789abcdef"}
KEY = ("cuda", "linear", 16, 3072, 1024, False, "torch.bfloat16", True, False, 3, (8192, 8192), True, 0.97)


def test_a_second_process_reads_the_winners_of_the_first(tmp_path):
    RaceCache(tmp_path, IDENTITY).put(KEY, "tma swap n64 k256 w4 st4", ("tma", 1, 1, 64, 256, 4, 4))
    RaceCache(tmp_path, IDENTITY).put(KEY[:2] + (64,) + KEY[3:], "cublas", None)
    fresh = RaceCache(tmp_path, IDENTITY)            # a new process: nothing in memory
    assert fresh.get(KEY) == ("tma swap n64 k256 w4 st4", ("tma", 1, 1, 64, 256, 4, 4))
    assert fresh.get(KEY[:2] + (64,) + KEY[3:]) == ("cublas", None)
    assert fresh.get(KEY[:2] + (1,) + KEY[3:]) is None
    assert len(list(tmp_path.iterdir())) == 1         # one file per identity, no temporaries left


def test_another_gpu_or_library_version_does_not_see_the_entries(tmp_path):
    RaceCache(tmp_path, IDENTITY).put(KEY, "cublas", None)
    for field, other in (("gpu", "NVIDIA H100"), ("triton", "3.7.0"), ("kernels", "fedcba9876543210")):
        assert RaceCache(tmp_path, dict(IDENTITY, **{field: other})).get(KEY) is None


def test_a_file_whose_identity_does_not_match_its_name_is_stale(tmp_path):
    cache = RaceCache(tmp_path, IDENTITY)
    cache.path.write_text(json.dumps({"identity": dict(IDENTITY, torch="2.9.0"),
                                      "choices": {repr(KEY): ["cublas", None]}}))
    assert RaceCache(tmp_path, IDENTITY).get(KEY) is None


@pytest.mark.parametrize("content", ["", "{not json", "[1, 2]", '{"identity": {}, "choices": []}', "\x00\xff"])
def test_a_corrupt_file_is_ignored_and_rewritten(tmp_path, content):
    cache = RaceCache(tmp_path, IDENTITY)
    cache.path.write_bytes(content.encode("latin-1"))
    assert RaceCache(tmp_path, IDENTITY).get(KEY) is None
    RaceCache(tmp_path, IDENTITY).put(KEY, "cublas", None)
    assert RaceCache(tmp_path, IDENTITY).get(KEY) == ("cublas", None)


def test_malformed_entries_are_dropped_and_good_ones_kept(tmp_path):
    good = KEY[:2] + (64,) + KEY[3:]
    cache = RaceCache(tmp_path, IDENTITY)
    cache.path.write_text(json.dumps({"identity": IDENTITY, "choices": {
        repr(KEY): ["triton n32 k256", [32, 256.5]],          # a float in a config
        repr(KEY[:2] + (2,) + KEY[3:]): "cublas",              # not a pair
        repr(KEY[:2] + (4,) + KEY[3:]): [7, None],             # a name that is no string
        repr(good): ["triton n32 k256", [32, 256]]}}))
    fresh = RaceCache(tmp_path, IDENTITY)
    assert fresh.get(KEY) is None and fresh.get(KEY[:2] + (2,) + KEY[3:]) is None
    assert fresh.get(KEY[:2] + (4,) + KEY[3:]) is None
    assert fresh.get(good) == ("triton n32 k256", (32, 256))


def test_the_folder_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DSCHAT_KERNEL_CACHE_DIR", str(tmp_path / "k"))
    assert race_cache.cache_folder() == tmp_path / "k"
    monkeypatch.setenv("DSCHAT_KERNEL_CACHE_DIR", "")
    assert race_cache.cache_folder() is None
    monkeypatch.delenv("DSCHAT_KERNEL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert race_cache.cache_folder() == tmp_path / "xdg" / "dschat" / "kernels"


def test_an_unwritable_folder_leaves_the_run_uncached(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = RaceCache(blocker / "kernels", IDENTITY)       # its parent is a file
    cache.put(KEY, "cublas", None)                          # logs, does not raise
    assert cache.get(KEY) == ("cublas", None)               # kept for this process


@pytest.fixture
def disk_on_cpu(tmp_path, monkeypatch):
    """The decode linears' race with its disk cache under tmp_path, a CPU device standing in for
    a GPU of IDENTITY (off CUDA nothing is timed: a call that finds no usable entry is None)."""
    monkeypatch.setenv("DSCHAT_KERNEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(linears, "_device_identity", lambda device: IDENTITY)
    monkeypatch.setattr(linears, "_DISK", {})
    monkeypatch.setattr(linears, "_CHOICE", {})
    return RaceCache(tmp_path, IDENTITY)


def _choose_on_cpu(n=3072, k=1024):
    w = torch.zeros(n, k)
    key = ("cpu", "linear", 16, n, k, False, "torch.bfloat16", True, False, 3, (8192, 8192), True, 0.97)
    return linears._choose(key, lambda cfg, w_: None, w)


def test_the_race_takes_a_cached_winner_it_would_have_offered(disk_on_cpu):
    disk_on_cpu.put(KEY, "triton n32 k256", (32, 256))
    assert _choose_on_cpu() == (32, 256)
    linears._CHOICE.clear()
    linears._DISK.clear()
    disk_on_cpu.put(KEY, "triton n32 k256 w8 st3", (32, 256, 8, 3))          # a refined config
    assert _choose_on_cpu() == (32, 256, 8, 3)


@pytest.mark.parametrize("name, cfg", [("triton n32 k256", (33, 256)),          # not this name's config
                                       ("triton n24 k256", (24, 256)),          # no such candidate
                                       ("triton n32 k256 w8 st9", (32, 256, 8, 9))])
def test_the_race_ignores_a_cached_winner_it_would_not_have_offered(disk_on_cpu, name, cfg):
    disk_on_cpu.put(KEY, name, cfg)
    assert _choose_on_cpu() is None
