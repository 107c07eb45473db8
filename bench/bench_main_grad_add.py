"""How GroupedLinear's sm90 wgrad adds into an aligned fp32 main_grad, by shape class: the TMA store's
reduce-add against the register epilogue reading main_grad (SPARSETRAIN_MAIN_GRAD_ADD forces each),
alternating, the faster of two rounds each, over G x mean rows an expert x (in, out), Dirichlet
routings (bench_grouped_linear.routing). The rule it sets: sm90::reduce_add_pays (docs/PERF.md).

    python bench/bench_main_grad_add.py [--json out.json]
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_grouped_linear import routing, time_ms  # noqa: E402

import sparsetrain  # noqa: E402

SHAPES = [(2048, 1536), (768, 2048), (7168, 4096), (4096, 14336)]  # (in, out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for k_in, n_out in SHAPES:
        for G in (8, 32, 128):
            for per_expert in (256, 512, 1024, 2048, 4096):
                T = G * per_expert
                if T > 131072 or (k_in * n_out > 8e6 and G > 32) or (k_in * n_out > 4e7 and G > 8):
                    continue  # keeps each case under ~15 ms and the main_grad under 4 GB
                torch.manual_seed(0)
                x = torch.randn(T, k_in, device="cuda", dtype=torch.bfloat16)
                dy = torch.randn(T, n_out, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(G, n_out, k_in, device="cuda", dtype=torch.bfloat16) / k_in ** 0.5
                main_grad = torch.zeros(G, n_out, k_in, device="cuda", dtype=torch.float32)
                splits = sparsetrain.DeviceSplits(torch.tensor(routing(G, T), device="cuda"))
                layer = sparsetrain.GroupedLinear(w, main_grad=main_grad, fuse_wgrad_accumulation=True,
                                                  delay_wgrad_compute=True)
                ms = {"reduce": [], "epilogue": []}
                for _ in range(2):
                    for how in ms:
                        os.environ["SPARSETRAIN_MAIN_GRAD_ADD"] = how
                        ms[how].append(time_ms(layer.backward_dw, min_reps=30, max_seconds=0.5,
                                               setup=lambda: layer.backward(x, dy, splits))[0])
                del os.environ["SPARSETRAIN_MAIN_GRAD_ADD"]
                r, e = min(ms["reduce"]), min(ms["epilogue"])
                rows.append(dict(k_in=k_in, n_out=n_out, G=G, rows_per_group=per_expert, reduce_ms=ms["reduce"],
                                 epilogue_ms=ms["epilogue"], ratio=r / e))
                print(f"in {k_in:5d} out {n_out:5d} G {G:3d} rows/group {per_expert:4d}  reduce {r:.3f} "
                      f"epilogue {e:.3f}  reduce/epilogue {r / e:.3f}", flush=True)
                del x, dy, w, main_grad, layer
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
