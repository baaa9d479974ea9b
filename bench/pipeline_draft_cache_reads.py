"""What rank 0 of a 2-rank specter pipeline reads from the checkpoint at load, on a draft cache miss
(every layer's routed experts, to quantise them) and then on a hit (its own stage's experts only):
`python bench/pipeline_draft_cache_reads.py [MODEL]` (default: the bundled model; a fresh cache)."""
import argparse
ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("model", nargs="?", help="checkpoint directory (default: the bundled model)")
args = ap.parse_args()  # before the imports below: --help answers at once
import tempfile, time, torch, specter
from specter.loader import _Reader, open_checkpoint
from specter.pipeline.load import load_stage
from specter.pipeline.stages import make_stages
path = args.model or specter.default_model_path()
ck = open_checkpoint(path); spec = ck.spec
first = make_stages(spec, 2, ck.dtype.itemsize, drafts=True)[0]
got = {}
orig = _Reader.read_into
def rec(self, name, dst):
    got[name] = dst.numel() * dst.element_size(); return orig(self, name, dst)
_Reader.read_into = rec
cache = tempfile.mkdtemp()
for what in ("miss", "hit"):
    got.clear(); t = time.perf_counter()
    st = load_stage(path, first, torch.device("cpu"), policy="specter", residency=0.5, draft_cache=cache, threads=1)
    dt = time.perf_counter() - t; st.close()
    ex = sum(v for k, v in got.items() if ".experts." in k); other = sum(v for k, v in got.items() if ".experts." not in k)
    print(f"{what}: stage {first.first}-{first.last} of {spec.n_layers}; experts read {ex/2**20:.1f} MiB, other {other/2**20:.1f} MiB, load {dt:.2f} s")
