"""`edgellm pull / list / rm` and --model REPO[:QUANT] against a loopback Hub (tests/fake_hub.py) serving tiny
GGUF repos: quant choice, shards, a cut download resumed, a bad sha256, offline, the store round trip."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fake_hub import FakeHub
from tiny_models import tiny_spec, write_spec

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("hub_files")
    (d / "split").mkdir()
    return {
        "q8": write_spec(d / "tiny-llama-Q8_0.gguf", tiny_spec("llama", qtype="Q8_0")),
        "f16": write_spec(d / "tiny-llama-F16.gguf", tiny_spec("llama", qtype="F16")),
        "q8b": write_spec(d / "tiny-llama-seed1-Q8_0.gguf", tiny_spec("llama", qtype="Q8_0", seed=1)),
        "split": write_spec(d / "split" / "tiny-llama-Q8_0.gguf", tiny_spec("llama", qtype="Q8_0"),
                            split_max_tensors=8),
    }


@pytest.fixture(scope="module")
def hub(files):
    shards = sorted(files["split"].parent.glob("*.gguf"))
    assert len(shards) == 3
    with FakeHub() as h:
        h.add_repo("tiny/llama-GGUF", {"README.md": b"# tiny llama\n", "mmproj-tiny-llama-F16.gguf": files["f16"],
                                       "tiny-llama-Q4_K_M.gguf": files["q8b"], "tiny-llama-Q8_0.gguf": files["q8"]})
        h.add_repo("tiny/q8-GGUF", {"a-F16.gguf": files["f16"], "b-Q8_0.gguf": files["q8"]})
        h.add_repo("tiny/plain-GGUF", {"mmproj-x-F16.gguf": files["f16"], "x-F16.gguf": files["f16"],
                                       "y-BF16.gguf": files["q8"]})
        h.add_repo("tiny/split-GGUF", {p.name: p for p in shards} | {"tiny-llama-F16.gguf": files["f16"]})
        h.add_repo("tiny/twins-GGUF", {"a-Q8_0.gguf": files["q8"], "b-Q4_K_M.gguf": files["q8"]})
        for name in ("bad", "cut", "auto", "tok"):
            h.add_repo(f"tiny/{name}-GGUF", {f"{name}-Q8_0.gguf": files["q8"]})
        yield h


@pytest.fixture
def store(hub, tmp_path, monkeypatch):
    """A fresh, empty store (HF cache + edgellm cache) pointed at the fake Hub, for this test and its CLI runs."""
    import huggingface_hub.constants as hf_constants

    for var in ("HF_TOKEN", "HF_HUB_OFFLINE", "HUGGINGFACE_HUB_CACHE", "EDGELLM_MODEL"):
        monkeypatch.delenv(var, raising=False)
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path / "hf_home"),
           "EDGELLM_CACHE": str(tmp_path / "edgellm"), "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_IMPLICIT_TOKEN", True)  # in-process pulls send no token
    hub.log.clear()
    return tmp_path


def cli(*args, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    return subprocess.run([sys.executable, "-m", "edgellm.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(REPO_ROOT), env=full)


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgellm: error: "), r.stderr
    return lines[0]


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def pull(text: str, **kw):
    from edgellm.model_pull import pull as run
    from edgellm.model_store import parse_ref

    return run(parse_ref(text), progress=kw.pop("progress", False), **kw)


def repo_cache(store: Path, repo: str) -> Path:
    return store / "hub" / ("models--" + repo.replace("/", "--"))


# -- pulls ----------------------------------------------------------------------------------------------------
def test_pull_by_tag_stores_the_file_in_the_hf_cache(store, hub, files):
    r = cli("pull", "tiny/llama-GGUF:q8_0")  # tags match case-insensitively, as llama.cpp's
    assert r.returncode == 0, r.stderr
    assert "tiny/llama-GGUF:Q8_0" in r.stdout
    commit = hub.repos["tiny/llama-GGUF"].commit
    snap = repo_cache(store, "tiny/llama-GGUF") / "snapshots" / commit / "tiny-llama-Q8_0.gguf"
    assert snap.is_symlink() and Path(os.path.realpath(snap)).name == sha256(files["q8"])  # huggingface_hub's layout
    assert snap.read_bytes() == files["q8"].read_bytes()
    assert (repo_cache(store, "tiny/llama-GGUF") / "refs" / "main").read_text() == commit
    downloads = {Path(q.path).name for q in hub.requests("GET", "/blobs/")}
    assert downloads == {sha256(files["q8"])}  # only the file the tag picked


def test_default_quant_choice_is_llama_cpps(store, files):
    from edgellm.errors import ModelNotFoundError

    assert pull("tiny/llama-GGUF").files[0].name == "tiny-llama-Q4_K_M.gguf"  # Q4_K_M first
    assert pull("tiny/q8-GGUF").files[0].name == "b-Q8_0.gguf"  # then Q8_0
    assert pull("tiny/plain-GGUF").files[0].name == "x-F16.gguf"  # then the first model file (not mmproj)
    assert pull("tiny/q8-GGUF:F16").files[0].name == "a-F16.gguf"
    with pytest.raises(ModelNotFoundError, match=r"no GGUF file for quant 'Q5_K_M'; it has: Q4_K_M, Q8_0$"):
        pull("tiny/llama-GGUF:Q5_K_M")
    with pytest.raises(ModelNotFoundError, match="no model repo tiny/nothing-GGUF"):
        pull("tiny/nothing-GGUF")


def test_sharded_repo_pulls_every_shard_and_loads_as_one(store, hub, files):
    from edgellm.api import load_model
    from edgellm.gguf_file import read_gguf

    m = pull("tiny/split-GGUF")
    assert [f.name for f in m.files] == [f"tiny-llama-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    lm = load_model("tiny/split-GGUF:Q8_0")  # --model REPO:QUANT resolves to the first shard, from the store
    assert lm.path == m.path and len(lm.gguf.paths) == 3
    whole = read_gguf(files["q8"])
    assert set(lm.gguf.tensors) == set(whole.tensors)
    for name in whole.tensors:
        np.testing.assert_array_equal(lm.gguf.tensor_bytes(name), whole.tensor_bytes(name))


@pytest.mark.parametrize("mode", ["close", "reset"])
def test_download_cut_halfway_resumes_with_a_range_request(store, hub, files, monkeypatch, mode):
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)  # written chunk by chunk: resumable mid-file
    hub.cut("tiny/cut-GGUF", "cut-Q8_0.gguf", mode)
    m = pull("tiny/cut-GGUF:Q8_0")
    assert sha256(m.path) == sha256(files["q8"])
    gets = hub.requests("GET", "/blobs/")
    size = files["q8"].stat().st_size
    assert len(gets) == 2 and gets[0].range is None
    start = int(gets[1].range.removeprefix("bytes=").rstrip("-"))
    assert 0 < start < size and start % (1 << 16) == 0  # resumed after the bytes already written, not from 0


def test_interrupted_pull_resumes_on_the_next_pull(store, hub, files, monkeypatch):
    import huggingface_hub.constants as hf_constants

    from edgellm import model_pull
    from edgellm.errors import ModelDownloadError

    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)
    monkeypatch.setattr(model_pull, "ATTEMPTS", 2)
    monkeypatch.setattr(model_pull, "BACKOFF_S", 0.0)
    hub.cut("tiny/cut-GGUF", "cut-Q8_0.gguf", "reset", "reset")
    with pytest.raises(ModelDownloadError, match="run the pull again to resume"):
        pull("tiny/cut-GGUF:Q8_0")
    part = next((repo_cache(store, "tiny/cut-GGUF") / "blobs").glob("*.incomplete"))
    kept = part.stat().st_size
    assert kept > 0 and not list((repo_cache(store, "tiny/cut-GGUF") / "snapshots").rglob("*.gguf"))
    m = pull("tiny/cut-GGUF:Q8_0")
    assert sha256(m.path) == sha256(files["q8"]) and not part.exists()
    assert hub.requests("GET", "/blobs/")[-1].range == f"bytes={kept}-"


def test_bad_sha256_is_a_named_error_and_nothing_is_stored(store, hub):
    hub.advertise("tiny/bad-GGUF", "bad-Q8_0.gguf", "0" * 64)
    line = one_line_error(cli("pull", "tiny/bad-GGUF:Q8_0"))
    assert "bad-Q8_0.gguf" in line and "sha256" in line and "nothing was stored" in line
    assert not repo_cache(store, "tiny/bad-GGUF").exists()
    assert not [p for p in (store / "hub").rglob("*") if p.is_file() and p.suffix != ".lock" and p.name != "CACHEDIR.TAG"]
    listed = json.loads(cli("list", "--json").stdout)
    assert not [m for m in listed if m["name"].startswith("tiny/bad")]


def test_offline_and_no_network_are_one_line_errors_naming_the_pull(store, hub):
    line = one_line_error(cli("pull", "tiny/llama-GGUF", env={"HF_HUB_OFFLINE": "1"}))
    assert "offline" in line and "edgellm pull tiny/llama-GGUF" in line
    line = one_line_error(cli("info", "-m", "tiny/auto-GGUF:Q8_0", "--offline"))
    assert "edgellm pull tiny/auto-GGUF:Q8_0" in line
    assert hub.requests() == []  # offline: not one request
    line = one_line_error(cli("pull", "tiny/llama-GGUF", env={"HF_ENDPOINT": "http://127.0.0.1:9"}))
    assert "cannot reach the Hugging Face Hub at http://127.0.0.1:9" in line and "edgellm pull tiny/llama-GGUF" in line
    pull("tiny/auto-GGUF:Q8_0")
    hub.log.clear()
    r = cli("info", "-m", "tiny/auto-GGUF:Q8_0", "--offline", "--json")  # a stored model needs no network
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["architecture"] == "llama" and hub.requests() == []


def test_model_repo_quant_is_pulled_on_first_use(store, hub, files):
    r = cli("info", "-m", "tiny/auto-GGUF:Q8_0", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert sha256(info["path"]) == sha256(files["q8"]) and info["kind"] == "base"
    assert len(hub.requests("GET", "/blobs/")) == 1
    hub.log.clear()
    r = cli("info", "-m", "tiny/auto-GGUF:Q8_0", "--json")  # stored now: used without asking the Hub
    assert r.returncode == 0 and json.loads(r.stdout)["path"] == info["path"] and hub.requests() == []


def test_the_token_goes_to_the_hub_not_to_the_cdn(store, hub):
    r = cli("pull", "tiny/tok-GGUF", env={"HF_TOKEN": "hf_" + "x" * 34, "HF_HUB_DISABLE_IMPLICIT_TOKEN": ""})
    assert r.returncode == 0, r.stderr
    api = hub.requests("GET", "/api/models/tiny/tok-GGUF") + hub.requests("HEAD", "/resolve/")
    cdn = hub.requests("GET", "/blobs/")
    assert api and all(q.auth for q in api)
    assert cdn and not any(q.auth for q in cdn)


def test_pull_shows_progress(store, capsys):
    pull("tiny/q8-GGUF:Q8_0", progress=True)
    err = capsys.readouterr().err
    assert "pulling b-Q8_0.gguf" in err and "100%" in err


# -- list / rm --------------------------------------------------------------------------------------------------
def test_list_and_rm_round_trip(store, hub, files):
    from huggingface_hub import hf_hub_download

    for ref in ("tiny/llama-GGUF:Q8_0", "tiny/llama-GGUF:Q4_K_M", "tiny/twins-GGUF:Q8_0", "tiny/twins-GGUF:Q4_K_M"):
        assert cli("pull", ref).returncode == 0
    hf_hub_download("tiny/plain-GGUF", "x-F16.gguf", cache_dir=str(store / "hub"), endpoint=hub.url)  # another tool
    listed = {m["name"]: m for m in json.loads(cli("list", "--json").stdout)}
    assert set(listed) >= {"tiny/llama-GGUF:Q8_0", "tiny/llama-GGUF:Q4_K_M", "tiny/twins-GGUF:Q8_0",
                           "tiny/twins-GGUF:Q4_K_M", "tiny/plain-GGUF:F16"}
    q8 = listed["tiny/llama-GGUF:Q8_0"]
    assert (q8["size"], q8["quant"], q8["architecture"], q8["context_length"], q8["kind"], q8["source"]) == \
        (files["q8"].stat().st_size, "Q8_0", "llama", 256, "base", "pulled")
    assert listed["tiny/plain-GGUF:F16"]["source"] == "hf-cache"
    assert [m["source"] for m in listed.values() if m["source"] == "bundled"] == ["bundled"]
    table = cli("list").stdout.splitlines()
    assert table[0].split() == ["NAME", "SIZE", "QUANT", "ARCH", "CONTEXT", "KIND", "SOURCE"]
    assert any(line.split()[0] == "tiny/llama-GGUF:Q8_0" and "llama" in line for line in table[1:])

    blob = Path(os.path.realpath(q8["path"]))
    r = cli("rm", "tiny/llama-GGUF:Q8_0")
    assert r.returncode == 0 and "removed tiny/llama-GGUF:Q8_0" in r.stdout
    assert not blob.exists()
    listed = {m["name"] for m in json.loads(cli("list", "--json").stdout)}
    assert "tiny/llama-GGUF:Q8_0" not in listed and "tiny/llama-GGUF:Q4_K_M" in listed
    assert "no stored model is called" in one_line_error(cli("rm", "tiny/llama-GGUF:Q8_0"))
    # twins share one blob: removing one keeps the other whole
    assert cli("rm", "tiny/twins-GGUF:Q8_0").returncode == 0
    r = cli("info", "-m", "tiny/twins-GGUF:Q4_K_M", "--offline", "--json")
    assert r.returncode == 0 and sha256(json.loads(r.stdout)["path"]) == sha256(files["q8"])
    # a repo with one model left: its name alone removes it, and the repo's folder goes with it
    assert cli("rm", "tiny/llama-GGUF").returncode == 0
    assert not repo_cache(store, "tiny/llama-GGUF").exists()
    from edgellm.model_path import bundled_name

    assert "bundled model" in one_line_error(cli("rm", bundled_name()))
