"""`final chat` as a user drives it: lines in, replies out, conversation kept across turns."""

from __future__ import annotations

import subprocess
import sys


def chat(*args: str, stdin: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "final.cli", "chat", "--model", "builtin:tiny-random-llama",
                           "--max-tokens", "4", "--temperature", "0", *args],
                          input=stdin, capture_output=True, text=True, timeout=300)


def test_chat_keeps_the_conversation_and_exits():
    res = chat(stdin="hello\nand again\n/exit\n")
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("assistant> ") == 2


def test_chat_with_tools_runs_the_multi_turn_path():
    res = chat("--tools", "tools.yaml", "--system", "Use tools.", stdin="What is 3+4?\n")
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("assistant> ") == 1


def test_chat_with_a_broken_tools_file_fails_clearly(tmp_path):
    bad = tmp_path / "tools.yaml"
    bad.write_text("tools: [{class_name: no.such.Tool, config: {type: native}}]\n")
    res = chat("--tools", str(bad), stdin="hi\n")
    assert res.returncode == 2 and "tools[0].class_name" in res.stderr and str(bad) in res.stderr
