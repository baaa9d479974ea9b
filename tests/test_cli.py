"""The command line as a user meets it: every option explained, --version, python -m specter,
token-id prompts for tokenizer-less checkpoints, chat, --dtype, penalties, argument checks, and
a closed pipe (`| head`) ending quietly."""
import io
import json
import os
import subprocess
import sys

import pytest

import specter
from specter.cli import build_parser, engine_options, main

DEFAULT = specter.default_model_path()
needs_default = pytest.mark.skipif(not (DEFAULT / "model.safetensors").exists(), reason="no bundled model")


def _parsers(parser, name="specter"):
    yield name, parser
    for action in parser._actions:
        if action.choices and hasattr(action, "_name_parser_map"):
            for sub, p in action._name_parser_map.items():
                yield from _parsers(p, f"{name} {sub}")


def test_every_option_has_help_text():
    missing = [f"{name} {'/'.join(a.option_strings) or a.dest}" for name, p in _parsers(build_parser())
               for a in p._actions if not a.help and not hasattr(a, "_name_parser_map")]
    assert not missing, f"options without --help text: {missing}"


def test_version_and_python_dash_m(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"specter {specter.__version__}"
    r = subprocess.run([sys.executable, "-m", "specter", "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == f"specter {specter.__version__}", r.stderr


def test_prompt_ids_on_a_checkpoint_without_tokenizer(tiny, capsys):
    path, _ = tiny("qwen3_moe", eos_token_id=None)
    engine = specter.load(path, device="cpu", policy="resident")
    want = engine.generate([1, 5, 9], max_new_tokens=6).token_ids
    base = ["generate", "--prompt-ids", "1,5,9", "--model", str(path), "--policy", "resident", "--device", "cpu",
            "--max-new-tokens", "6"]
    assert main(base) == 0  # streamed: the new token ids, as they come
    out = capsys.readouterr()
    assert [int(t) for t in out.out.split()] == want and "6 tokens" in out.err
    assert main(base + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want
    with pytest.raises(SystemExit) as e:  # argparse: a usage error, exit 2
        main(["generate", "--prompt-ids", "1,x", "--model", str(path)])
    assert e.value.code == 2 and "expected token ids" in capsys.readouterr().err
    assert main(["generate", "hi", "--prompt-ids", "1", "--model", str(path), "--policy", "resident"]) == 2
    assert "not both" in capsys.readouterr().err


@needs_default
def test_chat_and_system(chat_model, capsys):
    model = chat_model
    engine = specter.load(model, device="cpu", policy="resident")
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]
    want = engine.generate(msgs, max_new_tokens=8, temperature=0.0).token_ids
    assert want != engine.generate("def add(a, b):", max_new_tokens=8, temperature=0.0).token_ids
    argv = ["generate", "def add(a, b):", "--model", str(model), "--policy", "resident", "--device", "cpu",
            "--max-new-tokens", "8", "--json", "--greedy"]
    assert main(argv + ["--system", "be brief"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want
    assert main(argv + ["--chat"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == engine.generate(msgs[1:], max_new_tokens=8,
                                                                               temperature=0.0).token_ids
    # the bundled model has no chat template: one clear line
    assert main(["generate", "hi", "--chat", "--policy", "resident", "--device", "cpu"]) == 2
    assert "no chat template" in capsys.readouterr().err


@needs_default
def test_dtype_and_penalties_reach_the_engine(capsys):
    args = build_parser().parse_args(["generate", "x", "--dtype", "bfloat16"])
    assert engine_options(args) == {"dtype": "bfloat16"}
    argv = ["generate", "def add(a, b):", "--policy", "resident", "--device", "cpu", "--max-new-tokens", "12",
            "--json", "--repetition-penalty", "1.4", "--frequency-penalty", "0.5", "--min-p", "0.1"]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)["token_ids"]
    engine = specter.load(None, device="cpu", policy="resident")
    with pytest.warns(UserWarning, match=r"min_p \(--min-p\) has no effect"):  # (as the CLI's run above said)
        assert got == engine.generate("def add(a, b):", max_new_tokens=12, repetition_penalty=1.4,
                                      frequency_penalty=0.5, min_p=0.1).token_ids
    assert main(argv[:-6] + ["--dtype", "bfloat16"]) == 0  # runs in bf16 on CPU
    assert json.loads(capsys.readouterr().out)["token_ids"]
    assert main(argv + ["--presence-penalty", "5"]) == 2
    assert "--presence-penalty must be in [-2, 2]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "x", "--dtype", "int8"])


@needs_default
def test_stop_reads_backslash_escapes(capsys):
    """A shell cannot type a newline in quotes: --stop '\\n' was the two characters backslash and n, which
    code never contains, so the generation ran to its length."""
    args = build_parser().parse_args(["generate", "x", "--stop", r"\n", "--stop", r"\\n", "--stop", r"a\tb\d"])
    assert args.stop == ["\n", "\\n", "a\tb\\d"]
    argv = ["generate", "# sum\n", "--policy", "resident", "--device", "cpu", "--max-new-tokens", "24", "--greedy",
            "--json"]
    assert main(argv) == 0
    full = json.loads(capsys.readouterr().out)["text"]
    assert main(argv + ["--stop", r"\n"]) == 0
    assert "\n" in full and json.loads(capsys.readouterr().out)["text"] == full[:full.index("\n")]


@needs_default
def test_context_reaches_the_engine(capsys):
    """--context bounds a generation (exit 2, the engine's message) and plans the KV cache it keeps;
    with no --max-new-tokens the default (128) shrinks to the room the context leaves, as the server's."""
    argv = ["generate", "def add(a, b):", "--policy", "on-demand", "--device", "cpu", "--context", "16", "--json"]
    assert engine_options(build_parser().parse_args(argv)) == {"context": 16}
    assert main(argv + ["--max-new-tokens", "12"]) == 2
    err = capsys.readouterr().err
    assert "exceeds the engine's context of 16 tokens" in err and "--max-new-tokens" in err
    assert main(argv + ["--max-new-tokens", "4"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 4
    assert main(argv + ["--greedy"]) == 0  # 7 prompt tokens: 9 new fill the context (without an EOS first)
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["finish_reason"] == "length" and len(out["token_ids"]) == 9
    argv[argv.index("16")] = "7"  # the prompt fills the context: no room, and no --max-new-tokens to lower
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "leaves no room for a new token in the engine's context of 7 tokens" in err
    assert "shorten the prompt" in err and "lower" not in err
    with pytest.raises(SystemExit):
        main(["generate", "x", "--context", "0"])


@needs_default
def test_plan_refuses_a_negative_context(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--context", "-5"])
    assert e.value.code == 2 and "--context: expected an integer >= 1, got -5" in capsys.readouterr().err


@needs_default
@pytest.mark.parametrize("args, says", [
    (["--policy", "resident", "--residency", "0.5"], "residency=0.5 would be ignored"),
    (["--policy", "resident", "--expert-memory", "1MiB"], "expert_memory='1MiB' would be ignored"),
    (["--context", "999999999"], "exceeds the model's context of 2048 tokens"),
    (["--policy", "on-demand", "--draft-bits", "3"], "does not use --draft-bits"),
    (["--policy", "resident", "--compress-experts"], "does not use --compress-experts"),
])
def test_plan_refuses_what_generate_refuses(capsys, args, says):
    """plan planned these (50% resident for resident, a context silently capped, a draft width ignored)
    where generate refuses them."""
    assert main(["plan", *args]) == 2
    assert says in capsys.readouterr().err
    assert main(["generate", "x", "--max-new-tokens", "1", "--device", "cpu", *args]) == 2
    assert says in capsys.readouterr().err


def test_bench_names_the_runs_own_lengths_when_a_prompt_cannot_fit(capsys):
    """It named the warm-up's 4 new tokens, not the 16 asked for."""
    assert main(["bench", "--policies", "on-demand", "--context", "12", "--max-new-tokens", "16"]) == 2
    assert "+ max_new_tokens (16) =" in capsys.readouterr().err


def test_profile_refuses_trace_flags_without_trace_and_a_budget_for_resident(tmp_path, capsys):
    """Without --trace, --policy/--residency/--max-new-tokens were silently ignored; with it, resident took
    --residency 0.5 (and ignored it)."""
    assert main(["profile", "--policy", "resident"]) == 2
    assert "--policy applies to --trace only" in capsys.readouterr().err
    assert main(["profile", "--trace", str(tmp_path / "t.json"), "--policy", "resident", "--residency", "0.5"]) == 2
    assert "residency=0.5 would be ignored" in capsys.readouterr().err
    # and the reverse: the calibration's flags, bench's oracle and an empty prompt were taken by --trace, ignored
    trace = ["profile", "--trace", str(tmp_path / "t.json")]
    for extra, said in ((["--json"], "--json applies to the calibration"), (["--no-host"], "--no-host applies"),
                        (["--host-threads", "1"], "--host-threads applies"), (["--policy", "oracle"], "'oracle'"),
                        (["--prompt", " "], "--prompt is empty")):
        assert main(trace + extra) == 2 and said in capsys.readouterr().err, extra
    assert not (tmp_path / "t.json").exists()


def test_bench_refuses_a_policy_listed_twice(capsys):
    """on-demand,on-demand gave one row of both runs' tokens added, the first engine never closed."""
    assert main(["bench", "--policies", "on-demand,resident,on-demand"]) == 2
    assert "'on-demand' is listed twice" in capsys.readouterr().err


def test_bench_refuses_a_flag_none_of_its_policies_reads(capsys):
    for policies, flag in (("resident,on-demand", ["--k-max", "4"]), ("resident,spec-lru", ["--host-threads", "2"])):
        assert main(["bench", "--policies", policies, *flag]) == 2
        assert f"uses {flag[0]}, so it would be ignored" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["bench", "--policies", "resident", "--plot"], ["profile", "--trace"]])
def test_an_output_file_that_cannot_be_written_is_refused_before_the_work(tmp_path, capsys, command):
    """bench --plot ran its whole residency sweep, then died on the path with a traceback."""
    (tmp_path / "a-file").write_text("")
    for path, says in ((tmp_path / "a-file" / "out.png", "a-file is a file, not a folder"),
                       (tmp_path, "is a directory"), ("/proc/out.png", "cannot write it")):
        assert main([*command, str(path), "--model", str(tmp_path / "no-model")]) == 2  # the check comes first
        assert says in capsys.readouterr().err
    assert not (tmp_path / "deeper").exists()
    from specter.cli.options import output_file

    assert output_file(str(tmp_path / "deeper" / "x.json"), "--trace").parent.is_dir()  # made, as the command would
    assert not (tmp_path / "deeper" / "x.json").exists()  # and the file left as it was
    if command[0] == "bench":  # a format matplotlib cannot write, before the sweep too
        pytest.importorskip("matplotlib")
        assert main([*command, str(tmp_path / "plot.txt"), "--model", str(tmp_path / "no-model")]) == 2
        assert "matplotlib cannot write .txt files" in capsys.readouterr().err


@needs_default
def test_a_closed_pipe_ends_quietly():
    """`specter generate ... | head -2`: head leaves early; specter stops without a traceback."""
    gen = subprocess.Popen([sys.executable, "-m", "specter", "generate", "def f(x):\n    return x\n\n\ndef g(",
                            "--device", "cpu", "--policy", "resident", "--max-new-tokens", "400"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = subprocess.Popen(["head", "-2"], stdin=gen.stdout, stdout=subprocess.PIPE)
    gen.stdout.close()
    head_out, _ = head.communicate(timeout=120)
    err = gen.communicate(timeout=120)[1].decode()
    assert len(head_out.decode().splitlines()) <= 2
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert gen.returncode in (0, 141), (gen.returncode, err)


@needs_default
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_full_disk_under_the_output_is_one_line_not_a_traceback():
    """`specter generate ... > file` on a full disk: the write fails with ENOSPC; one line says so, exit 1."""
    with open("/dev/full", "w") as full:
        gen = subprocess.run([sys.executable, "-m", "specter", "generate", "def f(x):", "--device", "cpu",
                              "--policy", "resident", "--max-new-tokens", "8"],
                             stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert gen.returncode == 1, gen.stderr
    assert gen.stderr.strip().splitlines() == ["specter: error: could not write the output: No space left on device"]


def test_readme_lists_the_architectures_and_the_docs_stand_alone():
    from pathlib import Path

    from specter.config import SUPPORTED

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    for arch in SUPPORTED:
        assert f"| `{arch}` |" in readme, arch
    for doc in ("README.md", "docs/ARCHITECTURE.md"):
        text = (root / doc).read_text()
        assert "../shared" not in text and "DESIGN.md" not in text, doc  # a clone has no shared/


@needs_default
def test_interactive_chat(chat_model, capsys, monkeypatch):
    """`specter chat`: each input line is a user turn, answered through the chat template with the
    conversation so far; /reset starts over; the bundled model (no template) gets one clear line."""
    import io

    model = chat_model
    monkeypatch.setattr(sys, "stdin", io.StringIO("def add(a, b):\nclass Stack:\n/reset\n/help\nclass Stack:\n"))
    assert main(["chat", "--model", str(model), "--policy", "resident", "--device", "cpu",
                 "--max-new-tokens", "6", "--system", "be brief", "--greedy"]) == 0
    got = capsys.readouterr().out.split("\n")
    engine = specter.load(model, device="cpu", policy="resident")
    sys_msg = [{"role": "system", "content": "be brief"}]
    r1 = engine.generate(sys_msg + [{"role": "user", "content": "def add(a, b):"}], max_new_tokens=6, temperature=0.0).text
    r2 = engine.generate(sys_msg + [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": r1},
                                    {"role": "user", "content": "class Stack:"}], max_new_tokens=6, temperature=0.0).text
    r3 = engine.generate(sys_msg + [{"role": "user", "content": "class Stack:"}], max_new_tokens=6, temperature=0.0).text
    assert r2 != r3  # the history mattered
    assert "\n".join(got) == f"{r1}\n{r2}\n{r3}\n"  # (/help is said to stderr, not sent to the model)
    turn = sys_msg + [{"role": "user", "content": "def add(a, b):"}]  # no --max-new-tokens: the room left
    room = 40 - len(engine.encode(turn))
    want = engine.generate(turn, max_new_tokens=room, temperature=0.0).text
    monkeypatch.setattr(sys, "stdin", io.StringIO("def add(a, b):\n"))
    assert main(["chat", "--model", str(model), "--policy", "resident", "--device", "cpu", "--context", "40",
                 "--system", "be brief", "--greedy"]) == 0
    assert capsys.readouterr().out == want + "\n" and 0 < room < 128
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    assert main(["chat", "--policy", "resident", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "no chat template" in err and "`specter chat` cannot" in err and "--chat" not in err  # not generate's advice


class _Terminal(io.TextIOWrapper):
    """Standard input as a terminal's, from bytes."""

    def isatty(self):
        return True


@needs_default
def test_chat_lines_commands_bad_bytes_and_ctrl_c(chat_model, capsys, monkeypatch):
    """`specter chat`: empty lines send nothing, a mistyped /command is not a message, CRLF lines are the
    same messages, bytes that are not UTF-8 are one turn's error (in any locale: read as bytes); at a
    terminal Ctrl-C stops the reply in progress, which stays in the conversation as shown, and the chat
    goes on. A checkpoint without a chat template is refused before anything loads."""
    import signal

    import specter.cli.options as options

    model, base = chat_model, ["--policy", "resident", "--device", "cpu", "--greedy"]
    handler = signal.getsignal(signal.SIGINT)  # (SIG_IGN where the suite runs in the background, as CI's may)
    engine = specter.load(model, device="cpu", policy="resident")

    def reply(turns, n):
        return engine.generate(turns, max_new_tokens=n, temperature=0.0).text

    def user(text):
        return {"role": "user", "content": text}

    lines = b"\n   \n/exti\ncaf\xe9\ndef add(a, b):\r\n /tmp\n/EXIT\nclass Stack:\n"  # " /tmp": a message
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines), encoding="utf-8", errors="strict"))
    assert main(["chat", "--model", str(model), "--max-new-tokens", "5", *base]) == 0
    out, err = capsys.readouterr()
    first = reply([user("def add(a, b):")], 5)
    second = reply([user("def add(a, b):"), {"role": "assistant", "content": first}, user(" /tmp")], 5)
    assert out == first + "\n" + second + "\n"  # two turns, then /EXIT
    assert "unknown command /exti" in err and "not valid Unicode" in err

    n = 12
    class Interrupting:  # Ctrl-C once the reply's first piece is shown
        def __init__(self, out):
            self.out, self.writes = out, []

        def write(self, s):
            self.out.write(s)
            self.writes.append(s)
            if len(self.writes) == 1:
                os.kill(os.getpid(), signal.SIGINT)

        def flush(self):
            self.out.flush()

    monkeypatch.setattr(sys, "stdin", _Terminal(io.BytesIO(b"def add(a, b):\nclass Stack:\n")))
    monkeypatch.setattr(sys, "stdout", stdout := Interrupting(sys.stdout))
    assert main(["chat", "--model", str(model), "--max-new-tokens", str(n), *base]) == 0
    out, err = capsys.readouterr()
    first = "".join(stdout.writes[:stdout.writes.index("\n")])  # the pieces shown before the reply's end
    full = reply([user("def add(a, b):")], n)
    assert "(stopped)" in err and first and full.startswith(first) and len(first) < len(full)
    shown = [user("def add(a, b):"), {"role": "assistant", "content": first}, user("class Stack:")]
    assert out == first + "\n" + reply(shown, n) + "\n"  # the conversation holds the stopped reply as shown
    assert signal.getsignal(signal.SIGINT) is handler  # put back

    monkeypatch.setattr(sys, "stdout", stdout.out)
    for piped in ("def add(a, b):\n", "def add(a, b):"):  # generate --chat: the piped line is the message
        monkeypatch.setattr(sys, "stdin", io.StringIO(piped))
        assert main(["generate", "--chat", "--model", str(model), "--max-new-tokens", "5", *base]) == 0
        assert capsys.readouterr().out == reply([user("def add(a, b):")], 5) + "\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO("def add(a, b):\n"))  # "-" reads it too (it was the prompt "-")
    assert main(["generate", "--chat", "-", "--model", str(model), "--max-new-tokens", "5", *base]) == 0
    assert capsys.readouterr().out == reply([user("def add(a, b):")], 5) + "\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n"))
    assert main(["generate", "--chat", "--model", str(model), *base]) == 2
    assert "standard input was empty" in capsys.readouterr().err

    monkeypatch.setattr(options.specter, "load", lambda *a, **k: pytest.fail("loaded before the refusal"))
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    assert main(["chat", *base]) == 2 and "no chat template" in capsys.readouterr().err
    assert main(["generate", "--chat", "hi", *base]) == 2 and "drop --chat" in capsys.readouterr().err


def test_flags_a_policy_would_ignore_are_refused(tiny, capsys):
    path, _ = tiny("qwen3_moe")
    base = ["generate", "--prompt-ids", "1,2", "--model", str(path), "--device", "cpu", "--max-new-tokens", "2"]
    for extra, flag in [(["--policy", "on-demand", "--k-max", "4"], "--k-max"),
                        (["--policy", "resident", "--draft-cache", "off"], "--draft-cache"),  # no draft, no coded
                        (["--k-max", "0", "--residency", "0.5", "--draft-cache", "off"], "--draft-cache"),  # store
                        (["--policy", "resident", "--link", "H100-PCIe5"], "--link"),
                        (["--policy", "resident", "--residency", "0.5"], "residency=0.5")]:
        assert main(base + extra) == 2, extra
        assert flag in capsys.readouterr().err
    assert main(base + ["--policy", "on-demand", "--residency", "0.5", "--no-compile"]) == 0


def test_the_policy_table_decides_which_flags_each_policy_takes(tmp_path, capsys):
    """Every flag only some policies read is refused, before anything loads, by every policy whose
    record (specter/policy.py) says it does not read it; `specter --help` lists every policy."""
    from specter.cli.options import FLAG_USERS
    from specter.policy import POLICIES, POLICY

    values = {"--k-max": ["4"], "--compile": [], "--host-threads": ["2"], "--link": ["H100-PCIe5"], "--draft-bits": ["3"],
              "--compress-experts": []}
    base = ["generate", "--prompt-ids", "1,2", "--model", str(tmp_path / "nothing-here"), "--device", "cpu"]
    refused = []
    for flag, _, field in FLAG_USERS:
        for name in POLICIES:
            if not getattr(POLICY[name], field):
                assert main(base + ["--policy", name, flag, *values[flag]]) == 2, (name, flag)
                assert f"does not use {flag}" in capsys.readouterr().err
                refused.append((name, flag))
    assert ("on-demand", "--k-max") in refused and ("resident", "--link") in refused
    assert ("specter", "--host-threads") not in refused and ("host", "--k-max") in refused
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert all(f"\n  {name} " in text for name in POLICY)


@pytest.mark.parametrize("command", [["generate", "x"], ["chat"], ["serve"]])
def test_a_bench_only_policy_is_refused_where_a_policy_runs(capsys, command):
    """`oracle` (bench only, and left out of their --help) was taken by generate, chat and serve."""
    assert main([*command, "--policy", "oracle", "--device", "cpu"]) == 2
    assert "policy 'oracle' is bench only" in capsys.readouterr().err


def test_allowed_hosts_with_a_port_are_refused(capsys):
    """A Host header's port is not compared, so --allowed-hosts localhost:8000 refused every request,
    curl's "Host: localhost:8000" among them."""
    assert main(["serve", "--allowed-hosts", "a.example.com,localhost:8000", "--device", "cpu"]) == 2
    assert "give localhost, not localhost:8000" in capsys.readouterr().err


def test_a_flag_the_command_does_not_take_is_its_commands_error_with_the_nearest(capsys):
    """`generate x --temprature 0.5` printed the top level's usage ("specter: error: unrecognized arguments"),
    and `--max-new-token 5` was taken as --max-new-tokens (an abbreviation a later flag would make
    ambiguous): both are the command's usage error now, naming the flag it takes."""
    for argv, near in ((["generate", "x", "--temprature", "0.5"], "--temperature"),
                       (["generate", "x", "--max-new-token", "5"], "--max-new-tokens"),
                       (["plan", "--device-mem", "8GiB"], "--device-memory")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"specter {argv[0]}: error: unrecognized arguments" in err, err
        assert f"did you mean {near}?" in err, err


@pytest.mark.parametrize("argv, flag", [
    (["generate", "x", "--top-p", "1.5", "--temperature", "1"], "--top-p must be in (0, 1], got 1.5"),
    (["generate", "x", "--temperature", "-1"], "--temperature must be"),
    (["generate", "x", "--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1, got 0"),
    (["generate", "x", "--seed", str(-2**70), "--temperature", "1"], "--seed must be an integer in"),
    (["chat", "--top-k", "-1"], "--top-k must be an integer >= 0"),
    (["bench", "--top-p", "2", "--temperature", "1"], "--top-p must be in (0, 1]"),
    (["bench", "--max-new-tokens", "1"], "--max-new-tokens must be an integer >= 2, got 1: bench reports TPOT")])
def test_a_bad_sampling_flag_is_named_before_the_model_loads(capsys, monkeypatch, argv, flag):
    """`--top-p 1.5` loaded the model, then said "top_p must be in (0, 1]", the API's name: a flag's
    error names the flag, before any load (under torchrun too: every rank checks first)."""
    def no_load(*a, **k):
        raise AssertionError("loaded")

    monkeypatch.setattr(specter, "load", no_load)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("specter: error: ") and flag in err and "loaded" not in err


def test_ctrl_c_while_the_command_line_imports_ends_it_quietly(monkeypatch, capsys):
    """A Ctrl-C in the first seconds (torch importing) printed a 30-line KeyboardInterrupt traceback: the
    console script imported specter.cli, and with it torch, before main's handler existed. `import
    specter` imports no torch now, and the console script's main catches an interrupt in the imports."""
    import types

    from specter import console

    out = subprocess.run([sys.executable, "-c", "import sys, specter; print('torch' in sys.modules)"],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out

    class Interrupted(types.ModuleType):
        def __getattr__(self, name):
            raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "specter.cli", Interrupted("specter.cli"))
    assert console.main() == 130 and capsys.readouterr().err == "\n"
