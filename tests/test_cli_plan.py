"""`hybridkv plan` and the human size parsers it uses."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridkv.cli import main
from hybridkv.units import format_bytes, format_tokens, parse_bytes, parse_tokens

GiB = 2**30


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- size parsing --------------------------------------------------------------------

@pytest.mark.parametrize(
    "text, value",
    [
        ("40GiB", 40 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("40GB", 40 * 10**9),
        ("40gb", 40 * 10**9),
        ("2TiB", 2 * 2**40),
        ("8KiB", 8192),
        ("8kB", 8000),
        ("4096", 4096),
        ("4096B", 4096),
        (" 40 GiB ", 40 * 2**30),
        ("1_000", 1000),
        ("0.1KiB", 102),  # 102.4 rounds down
        ("0", 0),
    ],
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize(
    "text, match",
    [
        ("40G", "GiB .*GB"),
        ("40 GiBs", "unknown unit"),
        ("1,5GiB", "no commas"),
        ("4" * 31, "more than 30 digits"),
        ("-5GiB", "negative"),
        ("abc", "cannot read"),
        ("", "cannot read"),
        ("1.5", "whole"),
        ("1e9", "cannot read"),
        ("4,", "cannot read"),
        (".5GiB", "cannot read"),
    ],
)
def test_parse_bytes_errors(text, match):
    with pytest.raises(ValueError, match=match):
        parse_bytes(text)


@pytest.mark.parametrize(
    "text, value",
    [("128k", 131_072), ("128K", 131_072), ("1M", 1_048_576), ("8192", 8192), ("1.5k", 1536), ("8_192", 8192)],
)
def test_parse_tokens(text, value):
    assert parse_tokens(text) == value


@pytest.mark.parametrize(
    "text, match",
    [("1.1k", "whole number"), ("12x", "unknown unit"), ("8,192", "no commas"), ("-1k", "negative"), ("k", "cannot read"), ("1.5", "whole")],
)
def test_parse_tokens_errors(text, match):
    with pytest.raises(ValueError, match=match):
        parse_tokens(text)


def test_formatting():
    assert format_bytes(40 * GiB) == "40.00 GiB"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(512) == "512 B"
    assert format_tokens(131_072) == "128k"
    assert format_tokens(2**20) == "1M"
    assert format_tokens(100_000) == "100,000"


# --- the plan command ----------------------------------------------------------------

def test_default_plan_is_a_shared_arena(capsys):
    """``plan`` on defaults describes one shared arena. By hand (docs/planning.md, "Shared page
    space"), MXFP4: anchor page A = 877,632 B (c4a.compressed_kv), largest M = 1,609,920 B
    (swa_kv): head 2A = 1,755,264 B, slab 16A = 14,042,112 B, (40 GiB - head) // slab = 3,058
    slabs. N requests at 128k fit while the slabs their pages (plus one 8,192-token step in each
    sliding group) fill, counted at each group's fewest pages per slab, are at most 3,058."""
    head, slab = 2 * 877_632, 16 * 877_632
    slabs = (40 * GiB - head) // slab
    assert slabs == 3_058
    page_bytes = {"swa": 1_609_920, "c4s": 688_128, "c4kv": 877_632, "c128s": 655_360, "c128kv": 34_560,
                  "idx": 172_032}
    need = {"swa": 3, "c4s": 3, "c4kv": 513, "c128s": 17, "c128kv": 513, "idx": 3}  # pages a 128k request holds
    step = {"swa": 8192 // 64 + 1, "c4s": 8192 // 4 + 1, "c4kv": 0, "c128s": 8192 // 8 + 1, "c128kv": 0,
            "idx": 8192 // 4 + 1}
    per_slab = {g: min((head + (k + 1) * slab) // size - -(-(head + k * slab) // size) for k in range(slabs))
                for g, size in page_bytes.items()}
    assert per_slab == {"swa": 7, "c4s": 19, "c4kv": 16, "c128s": 20, "c128kv": 405, "idx": 80}

    def slabs_for(n):
        return sum(-(-(n * need[g] + step[g]) // per_slab[g]) for g in need)

    assert slabs_for(81) <= slabs < slabs_for(82)
    code, out, err = _run(capsys, "plan")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "40.00 GiB per GPU as one shared arena: 81 requests at 128k fit at once"
    assert lines[1] == "deepseek-v4-flash: 43 layers, MXFP4 indexer keys (68 B/row)"
    flat = " ".join(out.split())
    assert (f"shared arena 3,058 slabs x 13.39 MiB + 1.67 MiB of null pages = {head + slabs * slab:,} B "
            "of 42,949,672,960 B") in flat
    assert "per-group pools in the same budget fit 81 requests at 128k" in flat
    rows = {line.split()[0]: line.split() for line in lines if line.startswith("v4.")}
    assert rows["v4.c4a.compressed_kv"][-3:] == ["877,632", "513", "4,097"]  # page bytes, pages/req, width
    assert rows["v4.c128a.compressor_state"][-2:] == ["17", "18"]
    report = json.loads(_run(capsys, "plan", "--json")[1])
    assert report["page_space"] == "shared" and report["shared_arena"]["max_requests"] == 81


def test_per_group_plan(capsys):
    code, out, err = _run(capsys, "plan", "--page-space", "per-group")
    assert code == 0 and err == ""
    assert out.splitlines()[0] == (
        "40.00 GiB per GPU: 81 requests at 128k fit at once (limited by v4.c4a.compressed_kv)"
    )
    assert out.splitlines()[3].startswith("page space   per-group pools")
    assert out.splitlines()[1] == "deepseek-v4-flash: 43 layers, MXFP4 indexer keys (68 B/row)"
    assert "41,455 scheduler pages x 256 tokens = 10,612,480 tokens" in out
    # 81 x 131,072 = 10,616,832 > 10,612,480: the spare pages (41,584 = 41,455 + 128 + 1) say why.
    flat = " ".join(out.split())
    assert "81 x 128k = 10,616,832 tokens > the budget" in flat
    assert "(v4.c4a.compressed_kv: 41,584 = 41,455 + 128 + 1 null)" in flat
    assert "4,047.03 allocated vs 3,514.25 ideal" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("v4.")}
    assert rows["v4.c4a.compressed_kv"][4:7] == ["41,584", "877,632", "33.99"]
    assert rows["v4.swa_kv"][1:3] == ["window", "128"]
    assert rows["v4.c128a.compressor_state"][-1] == "18"  # table width


def test_pro_80gib_readable_table(capsys):
    code, out, _ = _run(capsys, "plan", "--model", "deepseek-v4-pro", "--kv-memory", "80GiB", "--context-len", "128k",
                        "--page-space", "per-group")
    assert code == 0
    # By hand: sliding groups fixed at 513 / 2,433 / 3,201 / 2,433 pages; each scheduler page
    # adds 30 * (37,440 + 4,352) + 31 * 1,728 bytes.
    fixed = 513 * 61 * 37_440 + 2_433 * 30 * 32_768 + 3_201 * 31 * 32_768 + 2_433 * 30 * 8_192
    per_page = 30 * 41_792 + 31 * 1_728
    pages = (80 * GiB - fixed) // per_page - 129
    assert pages == 59_906
    # 128k needs 513 pages of each compressed group: (59,906 + 129 - 1) // 513 = 117.
    assert out.splitlines()[0] == (
        "80.00 GiB per GPU: 117 requests at 128k fit at once (limited by v4.c4a.compressed_kv)"
    )
    assert f"= {pages * 256:,} tokens (token budget)" in out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert len(out.splitlines()) <= 18


def test_json_output(capsys):
    code, out, _ = _run(capsys, "plan", "--json", "--context-len", "64k")
    assert code == 0
    report = json.loads(out)
    assert report["scheduler_pages"] == 41_455
    assert report["concurrency"]["context_tokens"] == 65_536
    # Compressed groups fit (41,584 - 1) // ceil(65,537 / 256) = 161 and limit; the window
    # KV group fits (513 - 1) // ceil((127 + 1 + 63) / 64) = 512 // 3 = 170.
    assert report["concurrency"]["max_requests"] == 161
    assert report["concurrency"]["limiting_group"] == "v4.c4a.compressed_kv"
    assert [g["pages"] for g in report["groups"]] == [513, 2_433, 41_584, 3_201, 41_584, 2_433]


def test_options_reach_the_plan(capsys):
    code, out, _ = _run(
        capsys,
        "plan", "--json", "--indexer", "fp8", "--include-mtp", "--speculative-tokens", "5",
        "--max-running", "64", "--chunk-tokens", "4k", "--max-context", "256k", "--kv-memory", "20GB",
    )
    assert code == 0
    report = json.loads(out)
    assert report["limits"] == {
        "max_running_requests": 64,
        "max_scheduled_tokens": 4096,
        "max_context_tokens": 262_144,
        "speculative_tokens": 5,
    }
    assert report["budget_bytes"] == 20 * 10**9
    assert (report["indexer"], report["include_mtp"], report["num_layers"]) == ("fp8", True, 44)
    groups = {g["group_id"]: g for g in report["groups"]}
    assert groups["v4.c4a.compressed_kv"]["page_bytes"] == 21 * (37_440 + 64 * 132)
    assert groups["v4.c4a.compressor_state"]["sliding_window_tokens"] == 9
    # 64 * ceil((127 + 4) / 64) + ceil(4096 / 64) + 64 + 1
    assert groups["v4.swa_kv"]["pages"] == 64 * 3 + 64 + 65
    assert groups["v4.c4a.compressed_kv"]["table_width"] == -(-(262_144 + 5) // 256)


def test_context_len_defaults_to_128k_or_the_max_context(capsys):
    _, out, _ = _run(capsys, "plan", "--json")
    assert json.loads(out)["concurrency"]["context_tokens"] == 131_072
    code, out, _ = _run(capsys, "plan", "--json", "--max-context", "64k")
    assert code == 0
    report = json.loads(out)
    assert report["concurrency"]["context_tokens"] == 65_536
    assert report["limits"]["max_context_tokens"] == 65_536


def test_config_path(capsys, tmp_path):
    from hybridkv.models.layout import load_model_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps(load_model_config("deepseek-v4-flash")))
    _, by_name, _ = _run(capsys, "plan", "--json")
    for source in (str(path), str(tmp_path)):
        code, out, _ = _run(capsys, "plan", "--json", "--config", source)
        assert code == 0
        a, b = json.loads(out), json.loads(by_name)
        assert a["groups"] == b["groups"] and a["total_tokens"] == b["total_tokens"]
        assert a["model"] == source


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.fixture
def bad_configs(tmp_path):
    no_max = {
        "num_hidden_layers": 2,
        "compress_ratios": [4, 128],
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "index_head_dim": 128,
        "sliding_window": 128,
    }
    return {
        "broken": _write(tmp_path, "broken.json", "{"),
        "llama": _write(tmp_path, "llama.json", json.dumps({"model_type": "llama", "sliding_window": 8})),
        "no_max": _write(tmp_path, "nomax.json", json.dumps(no_max)),
        "missing": str(tmp_path / "absent.json"),
    }


BAD_INPUTS = [
    (["plan", "--model", "llama-3"], "unknown model 'llama-3'"),
    (["plan", "--config", "{missing}"], "no such model config"),
    (["plan", "--config", "{broken}"], "not valid JSON"),
    (["plan", "--config", "{llama}"], "not a DeepSeek-V4 config"),
    (["plan", "--config", "{no_max}"], "no max_position_embeddings: pass --max-context"),
    (["plan", "--model", "deepseek-v4-pro", "--config", "{llama}"], "not allowed with argument"),
    (["plan", "--kv-memory", "-5GiB"], "expected one argument"),
    (["plan", "--kv-memory=-5GiB"], "negative"),
    (["plan", "--kv-memory", "40G"], "GiB"),
    (["plan", "--kv-memory", "forty"], "cannot read 'forty'"),
    (["plan", "--kv-memory", "0"], "--kv-memory must be positive"),
    (["plan", "--kv-memory", "1MiB"], "1,048,576 B holds no slab: a shared arena needs 15,797,376 B at least"),
    (["plan", "--kv-memory", "1MiB", "--page-space", "per-group"], "too small.*at least 2,578,745,920 B"),
    (["plan", "--max-running", "-3"], "--max-running must not be negative"),
    (["plan", "--max-running", "0"], "--max-running must be positive"),
    (["plan", "--max-running", "1.5"], "--max-running: '1.5' is not a whole number"),
    (["plan", "--chunk-tokens", "8x"], "--chunk-tokens: unknown unit 'x'"),
    (["plan", "--chunk-tokens", "0"], "--chunk-tokens must be positive"),
    (["plan", "--max-context=-1M"], "negative"),
    (["plan", "--context-len", "2M"], "exceeds the max context"),
    (["plan", "--context-len", "100k", "--max-context", "64k"], "exceeds the max context"),
    (["plan", "--speculative-tokens", "0"], "must be positive"),
    (["plan", "--indexer", "fp4"], "invalid choice: 'fp4'"),
    (["plan", "--bogus"], "unrecognized arguments: --bogus"),
    (["plan", "extra"], "unrecognized arguments"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
]


@pytest.mark.parametrize("argv, match", BAD_INPUTS)
def test_bad_input_is_one_line_and_exit_2(capsys, bad_configs, argv, match):
    argv = [a.format(**bad_configs) for a in argv]
    code, out, err = _run(capsys, *argv)
    assert code == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("hybridkv: error: ")
    assert __import__("re").search(match, lines[0]), lines[0]


def test_no_subcommand_prints_help_and_exits_2(capsys):
    code, out, err = _run(capsys)
    assert code == 2 and out == ""
    assert "usage: hybridkv" in err and "plan" in err


def test_help_and_version(capsys):
    code, out, _ = _run(capsys, "plan", "--help")
    assert code == 0 and "--kv-memory" in out and "128k = 131072" in " ".join(out.split())
    code, out, _ = _run(capsys, "--version")
    assert code == 0 and out.startswith("hybridkv ")


def test_installed_console_script():
    script = Path(sys.executable).with_name("hybridkv")
    if not script.exists():
        pytest.skip("console script not installed next to this interpreter")
    env = dict(os.environ, COLUMNS="100")
    ok = subprocess.run([script, "plan", "--json"], capture_output=True, text=True, env=env, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["scheduler_pages"] == 41_455
    bad = subprocess.run([script, "plan", "--kv-memory", "lots"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.startswith("hybridkv: error: ") and "Traceback" not in bad.stderr


def test_shared_page_space_below_the_per_group_minimum(capsys):
    """2 GiB cannot hold per-group pools for 128 running (2.40 GiB): the per-group plan
    is refused; the shared one is printed with a note, and its JSON says so."""
    code, _, err = _run(capsys, "plan", "--kv-memory", "2GiB", "--page-space", "per-group")
    assert code == 2 and "at least 2,578,745,920 B" in err
    code, out, _ = _run(capsys, "plan", "--kv-memory", "2GiB", "--page-space", "shared")
    assert code == 0
    line = " ".join(out.split())
    # The headline describes the arena (no per-group pool figures, no "+286539.4%").
    assert out.startswith("2.00 GiB per GPU as one shared arena: ")
    assert "pools for 128 running requests do not fit 2.00 GiB (they need at least 2,578,745,920 B)" in line
    assert "only the shared arena runs in this budget" in line
    assert "holds 256 tokens" not in line and "%" not in line
    code, out, _ = _run(capsys, "plan", "--kv-memory", "2GiB", "--page-space", "shared", "--json")
    assert json.loads(out)["shared_arena"]["per_group_pools_fit"] is False


def test_shared_page_space_line_and_json(capsys):
    args = ("--indexer", "fp8", "--max-running", "256", "--chunk-tokens", "2048", "--max-context", "128k")
    code, out, _ = _run(capsys, "plan", "--page-space", "shared", *args)
    assert code == 0
    # 2,785 slabs of 16 x 963,648 B; the shared figure (79) beats the per-group pools' 73.
    line = " ".join(out.split())
    assert line.startswith("40.00 GiB per GPU as one shared arena: 79 requests at 128k fit at once")
    assert "shared arena 2,785 slabs x 14.70 MiB + 1.84 MiB of null pages" in line
    assert "pools in the same budget fit 73 requests at 128k" in line
    code, out, _ = _run(capsys, "plan", "--page-space", "shared", "--json", *args)
    shared = json.loads(out)["shared_arena"]
    assert shared == {
        "per_group_pools_fit": True,
        "total_bytes": 1_927_296 + 2785 * 15_418_368,
        "reserved_bytes": 1_927_296,
        "slab_bytes": 15_418_368,
        "num_slabs": 2785,
        "context_tokens": 131072,
        "max_requests": 79,
    }
    code, out, _ = _run(capsys, "plan", "--json", *args)
    assert json.loads(out)["shared_arena"] == shared  # the default page space
    code, out, _ = _run(capsys, "plan", "--json", "--page-space", "per-group", *args)
    assert "shared_arena" not in json.loads(out) and json.loads(out)["page_space"] == "per-group"
    code, _, err = _run(capsys, "plan", "--page-space", "pooled")
    assert code == 2 and "invalid choice" in err
