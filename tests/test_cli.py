"""`jpaged generate`: bad input exits 2 with one line and no traceback; --json has the documented shape.

In-process tests reuse the session's loaded model (`load_model` is pointed at it) so the suite
loads the GGUF once; one subprocess test runs the real console script end to end.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jpaged.engine import llm_engine
from jpaged.entrypoints import cli


@pytest.fixture
def run_cli(default_model, monkeypatch, capsys):
    monkeypatch.setattr(llm_engine, "load_model", lambda path, dtype=None: default_model if path is None
                        else REAL_LOAD_MODEL(path, dtype=dtype))

    def run(*argv):
        code = cli.main(["generate", *argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


REAL_LOAD_MODEL = llm_engine.load_model


@pytest.mark.parametrize("argv, message", [
    (["hi", "--model", "/no/such/model"], "/no/such/model"),
    (["hi", "--max-tokens", "0"], "max_tokens"),
    (["hi", "--temperature", "-1"], "temperature"),
    (["hi", "--top-p", "0"], "top_p"),
    (["hi", "--top-p", "1.5"], "top_p"),
    (["hi", "--top-k", "-1"], "top_k"),
    (["hi", "--block-size", "12"], "power of two"),
    (["   "], "empty"),
    (["hi", "--num-blocks", "3", "--block-size", "4"], "blocks"),
    (["word " * 9000, "--no-chat-template"], "context"),
])
def test_bad_input_exits_2_with_one_line(run_cli, argv, message):
    code, out, err = run_cli(*argv, "--max-tokens" if "--max-tokens" not in argv else "--json", *(
        ["4"] if "--max-tokens" not in argv else []))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert message in lines[0]
    assert "Traceback" not in err and out == ""


def test_not_a_model_directory(run_cli, tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    code, _, err = run_cli("hi", "--model", str(tmp_path))
    assert code == 2 and str(tmp_path) in err and "expected" in err


def test_json_output_in_input_order(run_cli):
    prompts = ["Name a fruit.", "What is 2+2?", "Say hello."]
    code, out, _ = run_cli(*prompts, "--json", "--max-tokens", "8", "--num-blocks", "64")
    assert code == 0
    lines = [json.loads(line) for line in out.strip().splitlines()]
    assert len(lines) == len(prompts) + 1
    for i, (record, prompt) in enumerate(zip(lines, prompts)):
        assert record["request_id"] == str(i) and prompt in record["prompt"]  # chat template wraps it
        (o,) = record["outputs"]
        assert 1 <= len(o["token_ids"]) <= 8 and o["finish_reason"] in ("stop", "length")
        assert o["cumulative_logprob"] < 0
    summary = lines[-1]["summary"]
    assert summary["num_requests"] == 3 and summary["num_blocks"] == 64
    assert summary["output_tokens"] == sum(len(r["outputs"][0]["token_ids"]) for r in lines[:-1])
    assert summary["free_blocks_at_end"] == 63 and 0 < summary["peak_used_blocks"] < 64
    assert summary["elapsed_s"] > 0 and "num_preemptions" in summary and "prefix_cache_hit_rate" in summary


def test_prompts_file_and_no_chat_template(run_cli, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"}) + "\n")
    code, out, _ = run_cli("--prompts-file", str(path), "--no-chat-template", "--json", "--max-tokens", "4",
                           "--num-blocks", "32")
    assert code == 0
    record = json.loads(out.splitlines()[0])
    assert record["prompt"].startswith("<|im_start|>")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    code, _, err = run_cli("--prompts-file", str(bad))
    assert code == 2 and "'prompt' field" in err


def test_console_script_answers_paris():
    """The README's first command, end to end in a fresh process."""
    result = subprocess.run([sys.executable, "-m", "jpaged.entrypoints.cli", "generate", "What is the capital of France?",
                             "--temperature", "0", "--max-tokens", "32", "--num-blocks", "64"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    summary = result.stderr.strip().splitlines()[-1]
    assert "tokens/s" in summary and "KV blocks peak" in summary and "/64" in summary
