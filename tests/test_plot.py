import json

from specter.cli import main


def test_bench_plot_sweeps_residencies_and_writes_a_png(tiny, tmp_path, capsys):
    path, _ = tiny("qwen3_moe")
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([[1, 2, 3, 4]]))
    png = tmp_path / "tpot.png"
    code = main(["bench", "--model", str(path), "--device", "cpu", "--policies", "resident,on-demand",
                 "--prompts", str(prompts), "--max-new-tokens", "4", "--plot", str(png), "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the shared pool's floor is one layer's top-2: 1/8 of 8 experts in each of the layers holds it
    assert set(out["residencies"]) == {"0.125", "0.25", "0.5", "1"}  # (as stderr says them)
    assert all(set(v) == {"resident", "on-demand"} for v in out["residencies"].values())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
