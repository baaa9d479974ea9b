"""`specter bench --plot`: TPOT per policy across residencies, one picture."""
from __future__ import annotations

RESIDENCIES = (0.125, 0.25, 0.5, 1.0)


def residency_sweep(model, policies: list[str], out_png: str, *, residencies=RESIDENCIES, **bench_kw) -> dict:
    from .bench import run_bench

    sweep = {}
    for r in residencies:
        res = run_bench(model, policies, residency=r, **bench_kw)
        sweep[str(r)] = {p: v["tpot_s"] for p, v in res["policies"].items()}
        print(f"residency {r:g}: " + ", ".join(f"{p} {v * 1e3:.2f} ms" for p, v in sweep[str(r)].items()), flush=True)
    draw(sweep, out_png, link=res.get("link"))
    print(f"wrote {out_png}")
    return {"residencies": sweep, "link": res.get("link"), "plot": out_png}


def draw(sweep: dict, out_png: str, link: str | None = None) -> None:
    try:
        import matplotlib
    except ImportError:
        from .errors import ConfigError

        raise ConfigError("--plot needs matplotlib: pip install 'specter[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [float(r) for r in sweep]
    policies = list(next(iter(sweep.values())))
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for p in policies:
        ax.plot(xs, [sweep[r][p] * 1e3 for r in sweep], marker="o", label=p)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.set_xlabel("residency (fraction of each layer's routed experts on the device)")
    ax.set_ylabel("TPOT (ms, lower is better)")
    ax.set_yscale("log")
    ax.set_title(f"Specter policies, link {link or '?'}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
