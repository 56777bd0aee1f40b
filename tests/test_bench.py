"""Smoke test of scripts/bench.py: one round on a tiny converted model, the JSON it writes, the table.
Never a timing assertion: the numbers depend on the machine."""
import json
import sys

import pytest
import torch

from scripts import bench
from tests.conftest import make_hf_model, save_and_convert


def test_bench_smoke(tmp_path):
    checkpoint = save_and_convert(make_hf_model("llama32"), tmp_path / "tiny")
    out = tmp_path / "results.json"
    args = bench.parse_args(["--quick", "--models", str(checkpoint.parent), "--configs", "brisk,llama.cpp",
                             "--precisions", "fp32,int8", "--prompts", "short,long", "--long_prompt", "300",
                             "--new_tokens", "4", "--roofline_mb", "16", "--work_dir", str(tmp_path / "work"),
                             "--llamacpp_dir", str(tmp_path / "none"), "--out", str(out), "--plot", ""])
    bench.main(args)

    report = json.loads(out.read_text())
    assert report["schema"] == 1 and report["roofline_gbps"] > 0
    assert {"cpu", "threads", "torch", "transformers"} <= set(report["machine"])
    # the long prompt exceeds the tiny model's 256-token context
    result, int8 = report["results"]
    # The runtime alone (torch and brisk's modules imported, no weights) holds less than a run does.
    assert 0 < report["runtime_rss_mb"] < result["peak_rss_mb"]
    assert (result["model"], result["prompt"], result["system"], result["precision"]) == ("tiny", "short", "brisk",
                                                                                           "fp32")
    assert (result["prompt_tokens"], result["new_tokens"]) == (bench.SHORT_PROMPT, 4)
    for key in ("decode_tok_s", "prefill_tok_s", "ttft_s", "peak_rss_mb", "bandwidth_gbps", "roofline_fraction"):
        assert result[key] > 0, key
    # The start (imports, loading, the first token) holds the time to the first token within it.
    assert result["start_s"] > result["ttft_s"] and result["start_s_max"] >= result["start_s"]
    # ... timed again by a second process right after the case's own (as llama.cpp's after llama-bench).
    again = result["rounds"][0]["start_s_again"]
    assert again > 0 and result["start_s"] == min(again, result["rounds"][0]["start_s"])
    n_params = sum(p.numel() for p in make_hf_model("llama32").parameters())
    assert result["bytes_per_token"] == 4 * n_params  # fp32 weights, the tied output counted once
    assert result["weights_bytes"] == result["bytes_per_token"]  # a step reads every weight
    # int8 holds the tied matrix once too (the embedding gathers the output's rows): what a step
    # reads, about a quarter of fp32's bytes (int8 weights, fp32 norms and scales).
    assert int8["precision"] == "int8"
    assert int8["weights_bytes"] == int8["bytes_per_token"]
    assert n_params <= int8["weights_bytes"] < 1.2 * n_params
    table = bench.format_table(report).splitlines()
    over_weights = f"{result['peak_rss_mb_min'] * 1e6 / result['weights_bytes']:.2f}x"
    assert any(line.startswith("tiny") and over_weights in line for line in table)
    assert len(result["rounds"]) == 1 and len(result["rounds"][0]["tokens"]) == 4
    skipped = {s["what"] for s in report["skipped"]}
    assert {"llama.cpp", "tiny long"} <= skipped
    assert "tiny" in bench.format_table(report)
    assert report["machine"]["isa"] == bench.cpu_isa() and report["machine"]["isa"] in bench.format_table(report)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/cpuinfo")
def test_cpu_isa_agrees_with_torch():
    """The flags the benchmark records agree with the ISA torch picked its kernels for."""
    isa = bench.cpu_isa()
    assert isa.startswith("family ") and ":" in isa
    flags = set(isa.split(":", 1)[1].split())
    assert flags <= set(bench.ISA_FLAGS)
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        assert {"avx512f", "avx512bw", "avx512vl", "avx2"} <= flags
    if capability.startswith("AVX2"):
        assert "avx2" in flags


def test_a_capped_run_says_so(monkeypatch):
    """A run under ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA (an AVX-512 machine running the paths of a
    CPU with AVX2 alone) names the caps beside the CPU's own flags in its tables' and plot's titles."""
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    m = dict(cpu="X", isa="family 6 model 1: avx2 avx512f", cpu_capability="AVX512", caps=bench.isa_caps())
    assert bench.where_cpu(m) == "X (family 6 model 1: avx2 avx512f)"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    m["caps"] = bench.isa_caps()
    assert bench.where_cpu(m) == ("X (family 6 model 1: avx2 avx512f; capped: ATEN_CPU_CAPABILITY=avx2 "
                                  "ONEDNN_MAX_CPU_ISA=AVX2)")


@pytest.mark.slow  # ~25 s: three precisions, the transformers peer and the profiler
def test_roofline_smoke(tmp_path, capsys):
    """scripts/roofline.py on the CPU: random weights of a config's shape, each precision, the peer,
    the profile; the bytes a step reads counted by brisk and by transformers' own parameters agree."""
    from model import ModelArgs
    from scripts import roofline
    ModelArgs(n_layer=2, dim=64, n_head=4, n_local_heads=2, vocab_size=320, intermediate_size=128,
              block_size=128).to_json(tmp_path / "config.json")
    out = tmp_path / "roofline.json"
    roofline.main(["--model", str(tmp_path / "config.json"), "--device", "cpu", "--no-compile",
                   "--precisions", "fp32,int8,int4", "--new_tokens", "8", "--roofline_gb", "0.05", "--peer",
                   "--profile", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["roofline_gbps"] > 0 and json.loads(capsys.readouterr().out) == report
    rows = {(r["system"], r["precision"]): r for r in report["rows"]}
    assert set(rows) == {("brisk", "fp32"), ("transformers", "fp32"), ("brisk", "int8"), ("brisk", "int4")}
    assert not [r["error"] for r in rows.values() if "error" in r]
    for r in rows.values():
        assert r["synced_tok_s"] > 0 and r["synced_roofline"] > 0
    for p in ("fp32", "int8", "int4"):
        # unread: the difference of two timings a few steps apart, none where it came out negative
        unread = rows["brisk", p]["unread_tok_s"]
        assert rows["brisk", p]["streamed_tok_s"] > 0 and (unread is None or unread > 0)
        assert rows["brisk", p]["host_ms_per_step"] > 0
    # 2 layers of q, k, v, o (64x64, 32x64 twice, 64x64), w1, w3, w2 (128x64) and norms, the final
    # norm and the output (320x64: whole blocks of kernels.cpp's packing), in fp32; of the embedding
    # table a step reads one row.
    layer = 64 * 64 * 2 + 32 * 64 * 2 + 128 * 64 * 3 + 64 * 2
    assert rows["brisk", "fp32"]["bytes_per_step"] == rows["transformers", "fp32"]["bytes_per_step"] \
        == 4 * (2 * layer + 64 + 320 * 64)
    assert rows["brisk", "int4"]["bytes_per_step"] < rows["brisk", "int8"]["bytes_per_step"] \
        < rows["brisk", "fp32"]["bytes_per_step"] / 3
