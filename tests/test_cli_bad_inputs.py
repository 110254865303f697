"""Every bad command line gives one line on stderr, ``hybridkv: error: ...``, and exit 2;
nothing on stdout, no traceback, and nothing is run first (checked by timing out
never: the bad flags are refused before planning or simulating).

The table drives ``hybridkv.cli.main`` in-process; a few cases also run the
installed console script.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybridkv.cli import main
from hybridkv.models.layout import load_model_config

LONG = "w" * 5000
DIGITS = "9" * 5000


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    flash = load_model_config("deepseek-v4-flash")

    def write(name, data, mode="w"):
        path = root / name
        if mode == "wb":
            path.write_bytes(data)
        else:
            path.write_text(data)
        return str(path)

    def config(name, **changes):
        return write(name, json.dumps({**flash, **changes}))

    no_max = {k: v for k, v in flash.items() if k != "max_position_embeddings"}
    (root / "empty_dir").mkdir()
    (root / "plot_dir.png").mkdir()
    return {
        "broken": write("broken.json", "{"),
        "nested": write("nested.json", "[" * 100_000 + "]" * 100_000),
        "latin1": write("latin1.json", '{"model_type": "d\xe9j\xe0"}'.encode("latin-1"), "wb"),
        "llama": write("llama.json", json.dumps({"model_type": "llama", "sliding_window": 8})),
        "no_max": write("nomax.json", json.dumps(no_max)),
        "no_mtp": config("nomtp.json", num_nextn_predict_layers=0),
        "negative": config("negative.json", compress_ratios=[-4] * 44),
        "head0": config("head0.json", head_dim=0),
        "missing": str(root / "absent.json"),
        "empty_dir": str(root / "empty_dir"),
        "plot_dir": str(root / "plot_dir.png"),
        "t_latin1": write("t1.jsonl", b'{"arrival": 0, "prompt_tokens": 8, "output_tokens": 2}\n{"arrival": 0, "x\xe9": 1}\n', "wb"),
        "t_nested": write("t2.jsonl", "[" * 100_000 + "]" * 100_000 + "\n"),
        "t_huge": write("t3.jsonl", '{"arrival": 0, "prompt_tokens": 1000000000000, "output_tokens": 1}\n'),
        "t_float": write("t4.jsonl", '{"arrival": 0, "prompt_tokens": 1e12, "output_tokens": 1}\n'),
        "t_empty": write("t5.jsonl", "\n\n"),
        "t_negative": write("t6.jsonl", '{"arrival": -1, "prompt_tokens": 8, "output_tokens": 1}\n'),
        "t_long": write("t7.jsonl", '{"arrival": 0, "prompt_tokens": 65536, "output_tokens": 1}\n'),
        "root": str(root),
    }


P = ["plan"]
S = ["simulate"]
BAD = [
    # numbers: one parser, the flag named, no commas, no digit leak
    (P + ["--kv-memory", "1,5GiB"], r"--kv-memory: cannot read '1,5GiB': no commas"),
    (P + ["--max-running", "1,5"], r"--max-running: cannot read '1,5': no commas"),
    (P + ["--chunk-tokens", "8,192"], r"--chunk-tokens: .*no commas"),
    (P + ["--kv-memory", DIGITS], r"--kv-memory: '9{37}\.\.\.' has more than 30 digits"),
    (P + ["--requests", DIGITS], r"--requests: .* has more than 30 digits"),
    (P + ["--kv-memory", "1000000TiB"], r"--kv-memory must be at most 64\.00 TiB"),
    (P + ["--kv-memory", "1000000TiB", "--page-space", "per-group"], r"--kv-memory must be at most 64\.00 TiB"),
    (P + ["--kv-memory", "40G"], r"--kv-memory: unknown unit 'G' .*write GiB .* or GB"),
    (P + ["--kv-memory", "forty"], r"--kv-memory: cannot read 'forty'"),
    (P + ["--kv-memory", "0"], r"--kv-memory must be positive"),
    (P + ["--kv-memory=-5GiB"], r"--kv-memory must not be negative"),
    (P + ["--kv-memory", "1e9"], r"--kv-memory: cannot read '1e9'"),
    (P + ["--kv-memory", ""], r"--kv-memory: cannot read ''"),
    (P + ["--kv-memory", "1.5"], r"--kv-memory: a plain byte count must be whole"),
    (P + ["--kv-memory", "1MiB"], r"holds no slab: a shared arena needs 15,797,376 B at least"),
    (P + ["--kv-memory", "1MiB", "--page-space", "per-group"], r"too small for per-group pools: .*at least 2,578,745,920 B.*or --page-space shared \(it reserves"),
    (P + ["--max-running", "0"], r"--max-running must be positive"),
    (P + ["--max-running", "1.5"], r"--max-running: '1.5' is not a whole number"),
    (P + ["--max-running", "2M"], r"--max-running must be at most 1,048,576"),
    (P + ["--max-running", "-3"], r"--max-running must not be negative"),
    (P + ["--chunk-tokens", "8x"], r"--chunk-tokens: unknown unit 'x'"),
    (P + ["--chunk-tokens", "0"], r"--chunk-tokens must be positive"),
    (P + ["--chunk-tokens", "1G"], r"--chunk-tokens must be at most 16,777,216"),
    (P + ["--max-context", "2M"], r"--max-context 2,097,152 exceeds the model's max_position_embeddings 1,048,576"),
    (P + ["--max-context", "99999999999"], r"--max-context must be at most 2,147,483,647"),
    (P + ["--max-context", "1e99"], r"--max-context: cannot read '1e99'"),
    (P + ["--context-len", "2M"], r"--context-len 2,097,152 exceeds the max context 1,048,576"),
    (P + ["--context-len", "100k", "--max-context", "64k"], r"--context-len 102,400 exceeds the max context 65,536"),
    (P + ["--speculative-tokens", "0"], r"--speculative-tokens must be positive"),
    (P + ["--speculative-tokens", "5000"], r"--speculative-tokens must be at most 1,024"),
    (P + ["--indexer", "fp4"], r"invalid choice: 'fp4'"),
    # names and files
    (P + ["--model", ""], r"--model must not be empty"),
    (P + ["--model", "   "], r"--model must not be empty"),
    (P + ["--model", "llama-3"], r"--model: unknown model 'llama-3'"),
    (P + ["--model", "deepseek-v4-pro", "--config", "{llama}"], r"not allowed with argument"),
    (P + ["--config", ""], r"--config must not be empty"),
    (P + ["--config", "{missing}"], r"no such model config"),
    (P + ["--config", "{empty_dir}"], r"no such model config .*config\.json"),
    (P + ["--config", "{broken}"], r"not valid JSON"),
    (P + ["--config", "{nested}"], r"JSON nested too deeply"),
    (P + ["--config", "{latin1}"], r"is not UTF-8 text"),
    (P + ["--config", "{llama}"], r"not a DeepSeek-V4 config"),
    (P + ["--config", "{no_max}"], r"no max_position_embeddings: pass --max-context"),
    (P + ["--config", "{negative}"], r"unsupported DeepSeek V4 compress_ratio=-4"),
    (P + ["--config", "{head0}"], r"config head_dim must be an integer >= 1"),
    (P + ["--config", "{no_mtp}", "--include-mtp"], r"include_mtp: the config has no MTP layer"),
    # the inverse plan and the engine comparison
    (P + ["--requests", "0"], r"--requests must be positive"),
    (P + ["--requests", "1M", "--context-len", "1M"], r"1,000,000 requests at 1,048,576 tokens need 3415\.88 TiB in per-group pools, beyond the 64\.00 TiB"),
    (P + ["--requests", "64", "--max-running", "32"], r"--requests 64 exceeds --max-running 32"),
    (P + ["--requests", "8", "--compare", "vllm"], r"answer different questions"),
    (P + ["--compare", "vllm", "--indexer", "mxfp4"], r"vLLM 0.33 caches V4's indexer keys in FP8"),
    (P + ["--compare", "vllm", "--include-mtp"], r"drop --include-mtp"),
    (P + ["--compare", "sglang"], r"invalid choice: 'sglang'"),
    (P + ["--bogus"], r"unrecognized arguments: --bogus"),
    (P + ["extra"], r"unrecognized arguments"),
    (["frobnicate"], r"invalid choice: 'frobnicate'"),
    # simulate: every flag checked before the run
    (S + ["--workload", ""], r"--workload must not be empty"),
    (S + ["--workload", LONG], r"--workload: file name too long \(5,000 characters"),
    (S + ["--workload", "nope"], r"workload must be one of chat, multiturn, longctx, agentic or a JSONL trace file"),
    (S + ["--workload", "{root}"], r"workload must be one of"),
    (S + ["--requests", "1000000000"], r"--requests must be at most 1,000,000"),
    (S + ["--requests", "0"], r"--requests must be positive"),
    (S + ["--seed=-1"], r"--seed must not be negative"),
    (S + ["--seed", "1.5"], r"--seed: '1.5' is not a whole number"),
    (S + ["--seed", DIGITS], r"--seed: .* has more than 30 digits"),
    (S + ["--plot", ""], r"--plot must not be empty"),
    (S + ["--plot", "/nonexistent/dir/x.png"], r"--plot: no such folder '/nonexistent/dir'"),
    (S + ["--plot", "run.gif"], r"--plot: unknown extension '.gif'"),
    (S + ["--plot", LONG + ".png"], r"--plot: file name too long"),
    (S + ["--plot", "{plot_dir}"], r"--plot: .* is a folder"),
    (S + ["--no-prefix-caching", "--state-checkpoint-interval", "512"], r"needs --prefix-caching"),
    (S + ["--checkpoint-policy", "every-boundary"], r"argument --checkpoint-policy: invalid choice: 'every-boundary'"),
    (S + ["--no-prefix-caching", "--checkpoint-policy", "terminal-and-junctions"], r"--checkpoint-policy needs --prefix"),
    (S + ["--checkpoint-policy", "interval"], r"--checkpoint-policy 'interval' needs --checkpoint-interval-tokens$"),
    (S + ["--checkpoint-interval-tokens", "512"],
     r"--checkpoint-interval-tokens applies to --checkpoint-policy 'interval' only, not 'prompt-boundaries'"),
    (S + ["--checkpoint-policy", "interval", "--checkpoint-interval-tokens", "0"],
     r"--checkpoint-interval-tokens must be positive"),
    (S + ["--checkpoint-policy", "interval", "--checkpoint-interval-tokens", "300", "--requests", "2"],
     r"--checkpoint-interval-tokens must be a positive multiple of the grain 256, got 300"),
    (S + ["--min-chunk-tokens=-1"], r"--min-chunk-tokens must not be negative"),
    (S + ["--kv-memory", "1MiB"], r"holds no slab"),
    (S + ["--kv-memory", "1MiB", "--page-space", "per-group"], r"too small"),
    (S + ["--kv-memory", "64TiB", "--page-space", "per-group"],
     r"--kv-memory: [0-9,]+ pages of v4\.c4a\.compressed_kv are more than the 16,777,216"),
    (S + ["--kv-memory", "64TiB", "--page-space", "shared"], r"--kv-memory: [0-9,]+ pages of .* are more than"),
    (S + ["--max-context", "2M"], r"exceeds the model's max_position_embeddings"),
    # simulate --instances / --tier
    (S + ["--instances", "0", "--tier", "host"], r"--instances must be positive"),
    (S + ["--instances", "1,5", "--tier", "host"], r"--instances: cannot read '1,5': no commas"),
    (S + ["--instances", "65", "--tier", "host"], r"--instances must be at most 64"),
    (S + ["--instances", "2.5", "--tier", "host"], r"--instances: '2.5' is not a whole number"),
    (S + ["--instances", "4"], r"--instances needs --tier"),
    (S + ["--tier", "s3"], r"argument --tier: invalid choice: 's3'"),
    (S + ["--tier", "host", "--no-prefix-caching"], r"--tier needs --prefix-caching"),
    (S + ["--tier-memory", "4GiB"], r"--tier-memory needs --tier"),
    (S + ["--no-write-through"], r"--write-through needs --tier"),
    (S + ["--in-flight-wait", "4"], r"--in-flight-wait needs --tier"),
    (S + ["--tier", "host", "--in-flight-wait", "-1"], r"--in-flight-wait must not be negative"),
    (S + ["--tier", "host", "--in-flight-wait", "10001"], r"--in-flight-wait must be at most 10,000"),
    (S + ["--tier", "host", "--tier-memory", "0"], r"--tier-memory must be positive"),
    (S + ["--tier", "host", "--tier-memory", "4G"], r"--tier-memory: unknown unit 'G'"),
    (S + ["--tier", "host", "--tier-memory", "1000000TiB"], r"--tier-memory must be at most 64\.00 TiB"),
    (S + ["--tier", "mooncake", "--tier-memory", "1MiB"], r"--tier-memory: a Mooncake segment needs at least 16MiB"),
    # traces: the path, the line, the reason
    (S + ["--workload", "{t_latin1}"], r"t1\.jsonl: line 2: not UTF-8 text \(byte 0xe9"),
    (S + ["--workload", "{t_nested}"], r"t2\.jsonl: line 1: JSON nested too deeply"),
    (S + ["--workload", "{t_huge}"], r"t3\.jsonl: line 1: prompt and output tokens \(1,000,000,000,001\) exceed"),
    (S + ["--workload", "{t_float}"], r"t4\.jsonl: line 1: 'prompt_tokens' must be a positive int"),
    (S + ["--workload", "{t_empty}"], r"t5\.jsonl: trace holds no requests"),
    (S + ["--workload", "{t_negative}"], r"t6\.jsonl: line 1: 'arrival' must be finite and >= 0"),
    (S + ["--workload", "{t_long}", "--max-context", "64k"], r"t7\.jsonl: line 1: .*exceed 65,536, the longest request allowed"),
    # plan's question, not simulate's: simulate takes no --context-len
    (S + ["--context-len", "64k"], r"unrecognized arguments: --context-len 64k"),
    # verify's own arguments
    (["verify", "--seed", "abc"], r"--seed: cannot read 'abc'"),
    (["verify", "--seed", "-1"], r"--seed must not be negative, got '-1'"),  # was numpy's words, after the run began
    (["verify", "--scenarios", "-1"], r"--scenarios must not be negative, got '-1'"),  # was "invalid _non_negative"
    (["verify", "--scenarios", "1001"], r"--scenarios must be at most 1,000"),
    (["verify", "--inject-fault", "nope"], r"invalid choice: 'nope'"),
]


def test_the_table_is_large_enough():
    assert len(BAD) >= 60


@pytest.mark.parametrize("argv, match", BAD, ids=[f"{i:02d}" for i in range(len(BAD))])
def test_bad_input_is_one_line_and_exit_2(capsys, files, argv, match):
    argv = [a.format(**files) if "{" in a and len(a) < 100 else a for a in argv]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, err
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("hybridkv: error: ")
    assert "Traceback" not in err and "set_int_max_str_digits" not in err
    assert len(lines[0]) <= 420
    assert re.search(match, lines[0]), lines[0]


def test_a_bom_trace_is_read(tmp_path, capsys):
    trace = tmp_path / "bom.jsonl"
    trace.write_bytes(b'\xef\xbb\xbf{"arrival": 0, "prompt_tokens": 300, "output_tokens": 2}\n')
    code = main(["simulate", "--workload", str(trace), "--kv-memory", "8GiB", "--max-context", "64k", "--json"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["requests_finished"] == 1


def test_counts_take_k_and_m(capsys):
    code = main(["plan", "--max-running", "1k", "--kv-memory", "80GiB", "--json"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["limits"]["max_running_requests"] == 1000


def test_plot_without_extension_writes_png_and_says_so(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    target = tmp_path / "myplot"
    code = main(["simulate", "--requests", "4", "--kv-memory", "8GiB", "--max-context", "64k", "--plot", str(target)])
    out = capsys.readouterr().out
    assert code == 0
    assert (tmp_path / "myplot.png").read_bytes()[:4] == b"\x89PNG"
    assert f"plot written to {target}.png" in out


def _script():
    script = Path(sys.executable).with_name("hybridkv")
    if not script.exists():
        pytest.skip("console script not installed next to this interpreter")
    return script


def test_console_script_reads_a_trace_from_stdin():
    line = '{"arrival": 0, "prompt_tokens": 300, "output_tokens": 2}\n'
    args = ["simulate", "--workload", "-", "--kv-memory", "8GiB", "--max-context", "64k", "--json"]
    done = subprocess.run([_script(), *args], input=line, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["requests_finished"] == 1


def test_console_script_one_line_for_a_huge_budget_in_shared_mode():
    done = subprocess.run(
        [_script(), "plan", "--page-space", "shared", "--kv-memory", "1000000TiB"],
        capture_output=True, text=True, timeout=60, env=dict(os.environ, COLUMNS="100"),
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "at most 64.00 TiB" in done.stderr


def test_plot_without_matplotlib_is_refused_before_the_run(monkeypatch, tmp_path, capsys):
    import importlib.util

    from hybridkv.cli import simulate_cmd

    real = importlib.util.find_spec
    monkeypatch.setattr(
        simulate_cmd.importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a)
    )
    ran = []
    monkeypatch.setattr(simulate_cmd, "build_plan", lambda args: ran.append(args))
    code = main(["simulate", "--plot", str(tmp_path / "run.png")])
    err = capsys.readouterr().err
    assert code == 2 and not ran
    assert "--plot needs matplotlib: pip install 'hybridkv[plot]' (in a source checkout: pip install -e '.[plot]')" in err
