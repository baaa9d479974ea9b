"""`specter bench --plot`: TPOT per policy across residencies, one picture."""
from __future__ import annotations

import os
import sys

from . import resolve_device
from .bench import check_run, load_once, run_bench
from .builder import hold_threads
from .errors import BudgetError, ConfigError
from .policy import BENCH_POLICIES, get as get_policy

RESIDENCIES = (0.125, 0.25, 0.5, 1.0)


def residency_sweep(model, policies: list[str], out_png: str, *, residencies=RESIDENCIES, **bench_kw) -> dict:
    check_format(out_png)  # before the sweep, not after it
    if not any(get_policy(p).offloads for p in policies if p in BENCH_POLICIES):
        raise ConfigError(f"--plot sweeps the residency, which none of the policies {', '.join(policies)} reads: "
                          f"add an offloading one (e.g. on-demand)")
    planned, refused = [], {}  # each residency checked before the load; one that cannot run (below top-k, or
    for r in residencies:      # more than the GPU holds) is skipped, and only a sweep where none can is refused
        try:
            check_run(model, policies, residency=r, expert_memory=None, device_memory=None, shared=None,
                      compare_compressed=False, **{k: v for k, v in bench_kw.items()
                                                   if k not in ("prompts", "repeat", "warmup")})
            planned.append(r)
        except BudgetError as e:
            refused[r] = e
    if not planned:
        raise BudgetError(f"no residency in the sweep ({', '.join(f'{r:g}' for r in residencies)}) can run: "
                          f"{refused[residencies[-1]]}")
    for r, e in refused.items():
        print(f"residency {r:g}: skipped ({e})", file=sys.stderr)
    release = hold_threads(resolve_device(bench_kw.get("device", "auto")))  # (its load sets torch's threads)
    try:
        shared = load_once(model, **{k: v for k, v in bench_kw.items()  # one load under every residency
                                     if k in ("device", "dtype", "threads", "draft_cache", "compress_experts",
                                              "draft_bits")})
        sweep, link = _sweep(model, policies, planned, shared, **bench_kw)
    finally:
        release()
    if not sweep:
        raise BudgetError("no residency in the sweep can hold one layer's top-k experts")
    draw(sweep, out_png, link=link)
    print(f"wrote {out_png}", file=sys.stderr)
    return {"residencies": sweep, "link": link, "plot": out_png}


def _sweep(model, policies: list[str], residencies, shared, **bench_kw) -> tuple[dict, str | None]:
    """residency_sweep's runs on one load: {residency: {policy: TPOT}} and the link's name."""
    sweep, link = {}, None
    for r in residencies:
        try:
            res = run_bench(model, policies, residency=r, shared=shared, **bench_kw)
        except BudgetError as e:  # below top-k experts per layer: this model cannot run there
            print(f"residency {r:g}: skipped ({e})", file=sys.stderr)
            continue
        link = res.get("link") or link
        sweep[f"{r:g}"] = {p: v["tpot_s"] for p, v in res["policies"].items() if v["tpot_s"] is not None}
        print(f"residency {r:g}: " + ", ".join(f"{p} {v * 1e3:.2f} ms" for p, v in sweep[f"{r:g}"].items()),
              file=sys.stderr, flush=True)
    return sweep, link


def _matplotlib():
    try:  # an optional dependency (specter[plot]): imported only when a plot is drawn
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'specter[plot]'") from None
    matplotlib.use("Agg")
    return matplotlib


def check_format(out: str) -> None:
    """A file name matplotlib can write (by its extension; none: PNG, the extension appended)."""
    _matplotlib()
    from matplotlib.figure import Figure

    kinds = Figure().canvas.get_supported_filetypes()
    suffix = os.path.splitext(out)[1].lower().lstrip(".")
    if suffix and suffix not in kinds:
        raise ConfigError(f"--plot {out}: matplotlib cannot write .{suffix} files; use one of "
                          f"{', '.join('.' + k for k in sorted(kinds))} (e.g. .png)")


def draw(sweep: dict, out_png: str, link: str | None = None) -> None:
    _matplotlib()
    import matplotlib.pyplot as plt

    xs = [float(r) for r in sweep]
    policies = list(next(iter(sweep.values())))
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for p in policies:
        ax.plot(xs, [sweep[r][p] * 1e3 for r in sweep], marker="o", label=p)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.set_xlabel("residency (share of the routed experts on the device, one pool for all layers)")
    ax.set_ylabel("TPOT (ms, lower is better)")
    ax.set_yscale("log")
    ax.set_title(f"Specter policies, link {link or '?'}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
