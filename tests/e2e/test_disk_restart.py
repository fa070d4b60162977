"""A worker that `anchorcache serve` restarts after a SIGKILL comes back warm from its disk
tier (docs/disk-tier.md): the next turn restores the conversation from the slab files, with
the output of an anchors-off run; corrupted files are skipped and the output is still that
of the anchors-off run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from anchorcache.cli import free_port, wait_ready
from anchorcache.testing.servers import ADMIN, ADMIN_TOKEN, Server, kill_tree, proxy_process

pytestmark = pytest.mark.slow

SYSTEM = {"role": "system", "content": "You are a concise assistant. Answer in one short sentence."}


@pytest.fixture(scope="module")
def off(worker) -> Iterator[Server]:
    with proxy_process(worker.url, "--no-anchors") as server:
        yield server


def ask(url: str, messages: list[dict]) -> dict:
    resp = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "model": "default", "messages": messages, "temperature": 0, "max_tokens": 12})
    assert resp.status_code == 200, resp.text
    return resp.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def slab_files(state_dir: Path) -> list[Path]:
    return sorted((state_dir / "anchor-disk").glob("*/*.slab"))


def wait_files(state_dir: Path, at_least: int) -> list[Path]:
    """The confirmed anchors' files, once the writer thread has put them down."""
    deadline = time.monotonic() + 60
    while len(found := slab_files(state_dir)) < at_least and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(found) >= at_least, found
    return found


def restart_worker(url: str) -> str:
    """SIGKILL serve's worker, wait for serve to bring a new one up; its epoch."""
    before = httpx.get(url + "/health", timeout=30).json()
    psutil.Process(before["worker_process"]["pid"]).kill()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        resp = httpx.get(url + "/health", timeout=30)
        body = resp.json()
        if resp.status_code == 200 and body["worker"]["epoch"] != before["worker"]["epoch"]:
            return body["worker"]["epoch"]
        time.sleep(0.3)
    raise AssertionError("serve did not restart its worker")


def admin(url: str, path: str) -> dict:
    resp = httpx.get(url + path, headers=ADMIN, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_restarted_worker_restores_from_disk_and_skips_corrupt_files(default_model_dir, off,
                                                                       tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "anchorcache.cli", "serve", "--port", str(port), "--threads", "2",
         "--log-level", "warning", "--model", str(default_model_dir),
         "--admin-token", ADMIN_TOKEN, "--state-dir", str(tmp_path)],
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}, start_new_session=True)
    try:
        wait_ready(url + "/health", proc, timeout_s=300)
        turn1 = [SYSTEM, {"role": "user", "content": "Name a primary color."}]
        first = ask(url, turn1)
        assert first["choices"][0]["message"] == ask(off.url, turn1)["choices"][0]["message"]
        written = wait_files(tmp_path, 2)  # at least the instruction and prompt-end anchors
        restart_worker(url)
        # the new worker indexed the files: listed on the disk tier, nothing in memory yet
        listed = admin(url, "/admin/slots")["data"]
        assert {s["tier"] for s in listed} == {"disk"}
        assert {(s["key"], s["depth"]) for s in listed} == {
            (f.name.split("-")[0], int(f.stem.split("-")[1])) for f in written}
        ops = subprocess.run([sys.executable, "-m", "anchorcache.cli", "ops", "slots", "--url", url,
                              "--token", ADMIN_TOKEN], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "COLUMNS": "250"})
        assert ops.returncode == 0 and "disk" in ops.stdout, ops.stdout + ops.stderr

        # the next turn: the previous prompt (and its reply) restored from the files
        turn2 = [*turn1, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And another one?"}]
        warm = ask(url, turn2)
        assert cached(warm) >= 0.9 * first["usage"]["prompt_tokens"], warm["usage"]
        assert warm["choices"][0]["message"] == ask(off.url, turn2)["choices"][0]["message"]
        disk = admin(url, "/admin/stats")["worker"]["disk"]
        assert disk["enabled"] and disk["loads"] >= 2 and disk["skips"] == 0, disk
        assert {s["tier"] for s in admin(url, "/admin/slots")["data"]} >= {"host"}
        # the proxy learned the restored links from the reply (held): the next turn plans on them
        learned = {r["depth"] for r in admin(url, "/admin/anchors")["data"]}
        assert learned and max(learned) <= warm["usage"]["prompt_tokens"]

        # every file damaged: skipped and quarantined; the output is still the cold run's
        files = wait_files(tmp_path, 3)
        restart_worker(url)  # the old worker's writes are all down (waited above)
        for f in slab_files(tmp_path):
            data = bytearray(f.read_bytes())
            data[-3] ^= 0xFF
            f.write_bytes(bytes(data))
        turn3 = [*turn2, {"role": "assistant", "content": warm["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "Thanks. One more?"}]
        cold = ask(url, turn3)
        assert cold["choices"][0]["message"] == ask(off.url, turn3)["choices"][0]["message"]
        assert cached(cold) == 0, cold["usage"]
        assert len(list((tmp_path / "anchor-disk" / "quarantine").iterdir())) >= 1
        disk = admin(url, "/admin/stats")["worker"]["disk"]
        assert disk["skips"] >= 1 and disk["loads"] == 0, disk
        ops = subprocess.run([sys.executable, "-m", "anchorcache.cli", "ops", "stats", "--url", url,
                              "--token", ADMIN_TOKEN], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "COLUMNS": "250"})
        assert ops.returncode == 0 and "disk" in ops.stdout, ops.stdout + ops.stderr
        assert len(files) >= 3
    finally:
        kill_tree(proc)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"], ids=["dense", "hybrid"])
def test_a_restarted_sglang_worker_restores_a_chain_from_disk(arch, tmp_path):
    """SGLang with the plugin, SIGKILLed and started again on the same disk directory: a
    tool + conversation chain comes back from the files (on the hybrid Qwen3.5, each slab
    with its recurrent and conv state) with the tokens of a cold run whose prefill chunks
    end at the same depths, logprobs to float32 rounding (`close`). The new process has a
    new epoch, and an anchor of the old one whose file is gone is not resident, though its
    key is the same. A file sent
    back over the contract (`/anchor/export`, evicted, `/anchor/import`) restores alike."""
    from transformers import AutoTokenizer

    from anchorcache.ext.embedded.tiny_models import (
        build_tiny_model,
        qwen3_tokenizer_dir,
        tiny_model_dir,
    )
    from anchorcache.testing.data import two_turn_prompts
    from anchorcache.testing.exactness import close, cold_cut, generate, restore, save
    from anchorcache.testing.servers import sglang_worker_process
    from anchorcache.testing.worker_api import flush_device

    model = str(build_tiny_model(arch, tiny_model_dir(arch)))
    tool, conv, p1, p2 = two_turn_prompts(
        AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir())), 1)[0]
    # float32 throughout (SGLang's --dtype auto serves the float32 model in float16 and keeps
    # a hybrid's conv window in bfloat16 unless told)
    args = ("--dtype", "float32", "--max-total-tokens", "6000")
    env = {"ANCHORCACHE_ANCHOR_DISK_DIR": str(tmp_path / "disk"),
           "SGLANG_MAMBA_CONV_DTYPE": "float32"}
    with sglang_worker_process(*args, model=model, env=env) as w1:
        cold = cold_cut(w1.url, p2, tool, conv)  # no anchors: no file
        assert cold["meta_info"]["cached_tokens"] == conv
        flush_device(w1.url)  # a hybrid's snapshot needs its prefix prefilled, not cached
        keys = save(w1.url, p1, tool, conv)
        assert conv + 8 < len(p2)
        flush_device(w1.url)
        gone = save(w1.url, p2, conv + 8)[conv + 8]  # an anchor whose file is deleted below
        old_epoch = httpx.get(w1.url + "/health", timeout=60).json()["epoch"]
        disk = tmp_path / "disk"
        deadline = time.monotonic() + 60
        while len(list(disk.glob("*/*.slab"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        w1.kill()
    files = [f for f in disk.glob("*/*.slab") if f.name.startswith(gone.hex())]
    assert len(files) == 1, sorted(f.name for f in disk.glob("*/*.slab"))
    files[0].unlink()
    with sglang_worker_process(*args, model=model, env=env) as w2:
        listing = httpx.get(w2.url + "/anchor/slots", timeout=60).json()
        assert {(d["key"], d["depth"]) for d in listing["disk"]} == \
            {(keys[tool].hex(), tool), (keys[conv].hex(), conv)}
        warm = generate(w2.url, p2, restore((tool, keys[tool]), (conv, keys[conv])),
                        logprobs=True)
        assert [r["depth"] for r in warm["meta_info"]["anchors"]["restored"]] == [tool, conv]
        assert warm["meta_info"]["cached_tokens"] == conv
        close(warm, cold)
        disk_stats = httpx.get(w2.url + "/anchor/stats", timeout=60).json()["disk"]
        assert disk_stats["loads"] == 2 and disk_stats["skips"] == 0, disk_stats
        assert warm["meta_info"]["epoch"] != old_epoch
        flush_device(w2.url)  # (the warm run left p2's prefix in SGLang's own cache)
        stale = generate(w2.url, p2, restore((conv + 8, gone)))
        # only what the files held comes back (the late lookup finds the chain at `conv`)
        anchors = stale["meta_info"]["anchors"]
        assert stale["meta_info"]["cached_tokens"] in (0, tool, conv), anchors
        assert [(m["key"], m["reason"]) for m in anchors["restore_miss"]] == \
            [(gone.hex(), "not_resident")], anchors

        # the conversation anchor's file leaves over the contract and comes back: exported,
        # evicted (file and slab), imported (a damaged copy is refused first), restored
        exported = httpx.post(w2.url + "/anchor/export", json={"key": keys[conv].hex()},
                              timeout=60)
        assert exported.status_code == 200, exported.text
        assert httpx.post(w2.url + "/anchor/evict", json={"key": keys[conv].hex()},
                          timeout=60).json()["evicted"]
        damaged = bytearray(exported.content)
        damaged[-5] ^= 1
        refused = httpx.post(w2.url + "/anchor/import", content=bytes(damaged), timeout=60)
        assert refused.status_code == 400, refused.text
        took = httpx.post(w2.url + "/anchor/import", content=exported.content, timeout=60)
        assert took.status_code == 200, took.text
        assert (took.json()["key"], took.json()["depth"], took.json()["imported"]) == \
            (keys[conv].hex(), conv, True)
        flush_device(w2.url)
        back = generate(w2.url, p2, restore((tool, keys[tool]), (conv, keys[conv])),
                        logprobs=True)
        assert [r["depth"] for r in back["meta_info"]["anchors"]["restored"]] == [tool, conv]
        assert back["meta_info"]["cached_tokens"] == conv
        close(back, cold)
