"""Training steps of sparsetrain's torch layers on static inputs, for the CUDA graph and stream
tests: one GroupedLinear, GroupedMLP or MoELayer step (LayerStep) or block_sparse_attention step
(AttentionStep) whose inputs are tensors a graph can read, new values loaded into them by seed
(uneven splits with empty and 1-7-row experts, new logits, new document boundaries), what a step
produced by name, and a bitwise comparison that fails on NaN; and, for the FP8 tests, what a
forward saved for its backward (saved_for_backward)."""

from collections import Counter

import torch

import sparsetrain as st
import sparsetrain.torch as stt

DEV = torch.device("cuda")
BF16 = torch.bfloat16
G, T, IN, FFN, OUT = 11, 1031, 392, 136, 200
FP8_IN, FP8_FFN, FP8_OUT = 400, 144, 208  # the FP8 recipe's features: multiples of 16
S_ATTN, H, D = 1031, 4, 128


def fp8_missing():
    """Why the CUDA FP8 recipe cannot run here (None when it can): its GEMMs are Hopper kernels of
    ALL builds only."""
    if torch.cuda.get_device_capability(0) != (9, 0):
        return "not a Hopper GPU (compute capability 9.0): the FP8 GEMMs are sm90a kernels"
    if st.build_info()["sm90_kernels"] != "an ALL build":
        return f"the CUDA FP8 GEMMs are in ALL builds only (this one: {st.build_info()['sm90_kernels']})"
    return None


def splits(seed, total, groups=G):
    """`groups` uneven splits summing to `total`: two empty experts, three of 1-7 rows, the rest
    drawn from a gamma distribution."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(groups, generator=g).tolist()
    empty, tiny, rest = perm[:2], perm[2:5], perm[5:]
    s = torch.zeros(groups, dtype=torch.int64)
    s[tiny] = torch.randint(1, 8, (3,), generator=g)
    w = torch._standard_gamma(torch.full((len(rest),), 0.7), generator=g)
    left = total - int(s.sum())
    s[rest] = (w / w.sum() * left).floor().long()
    s[rest[0]] += total - int(s.sum())
    assert int(s.sum()) == total and all(s[e] == 0 for e in empty)
    return s


def fill(t, zero):
    """t (if any) zeroed, or filled with NaN."""
    if t is not None:
        with torch.no_grad():
            t.zero_() if zero else t.fill_(float("nan"))


def assert_same(name, got, want, case):
    """Bitwise equal, NaN failing (a replay that wrote nothing leaves the NaN poison)."""
    assert got.shape == want.shape and got.dtype == want.dtype, f"{case}: {name}: {got.shape} vs {want.shape}"
    if got.is_floating_point():
        assert bool(torch.isfinite(got).all()), f"{case}: {name}: non-finite values (not written by the replay?)"
    if not torch.equal(got, want):
        diff = (got.double() - want.double()).abs().max().item()
        raise AssertionError(f"{case}: {name}: replay differs from the eager step (max |diff| {diff:.3e})")


# -- the steps -----------------------------------------------------------------------------------


class LayerStep:
    """One training step of a GroupedLinear, GroupedMLP or MoELayer on static inputs (the tensors a
    graph reads), and what it produces: outputs, input grads, parameter grads and main_grads."""

    def __init__(self, op, variant, seed=0, ffn=None):
        """variant: plain, fused (main_grad), fused_dummy, delayed, buffers, bias, fp8 (the FP8
        recipe, packed weights), fp8_fused (with main_grad) or, for the MoE layer, fp8_saved (with
        fc1's output held in e4m3: fp8_saved_activations). ffn: the MLP's width instead of the
        variant's (a multiple of 128 with FP8: the SwiGLU backward writes the codes itself)."""
        self.op, self.variant = op, variant
        torch.manual_seed(seed)
        fuse = variant in ("fused", "fused_dummy", "delayed", "fp8_fused")
        fp8 = variant.startswith("fp8")
        kw = dict(bias=variant == "bias", params_dtype=BF16, device=DEV, fuse_wgrad_accumulation=fuse,
                  delay_wgrad_compute=variant == "delayed", single_grouped_weight=variant != "plain", fp8=fp8)
        n_in, n_ffn, n_out = (FP8_IN, FP8_FFN, FP8_OUT) if fp8 else (IN, FFN, OUT)
        n_ffn = ffn or n_ffn
        if op == "linear":
            self.m = stt.GroupedLinear(G, n_in, n_out, **kw)
        elif op == "mlp":
            self.m = stt.GroupedMLP(G, n_in, n_ffn, n_out, **kw)
        else:
            self.m = stt.MoELayer(G, n_in, n_ffn, 3, normalize=True, fp8_saved_activations=variant == "fp8_saved",
                                  **kw)
        self.params = [p for p in self.m.parameters() if p.requires_grad]
        self.weights = [p for n, p in self.m.named_parameters() if "weight" in n]
        self.dummies = {id(w) for w in self.weights} if variant == "fused_dummy" else set()
        if fuse:
            for w in self.weights:
                w.main_grad = torch.zeros(w.shape, device=DEV, dtype=torch.float32)
                if variant == "fused_dummy":
                    w.grad_added_to_main_grad = False  # Megatron's attribute: the dummy wgrad
        rows = T if op != "moe" else T // 3
        # dy as y: with a caller `out` of more rows, y is that buffer (the library reads T rows).
        dy_rows = rows + 5 if variant == "buffers" else rows
        s = {"x": torch.empty(rows, n_in, device=DEV, dtype=BF16, requires_grad=True),
             "dy": torch.empty(dy_rows, n_out if op != "moe" else n_in, device=DEV, dtype=BF16)}
        if op == "moe":
            s["logits"] = torch.empty(rows, G, device=DEV, requires_grad=True)
        else:
            s["splits"] = torch.zeros(G, device=DEV, dtype=torch.int64)
        if op == "mlp":
            s["probs"] = torch.empty(rows, device=DEV, requires_grad=True)
        if variant == "buffers":
            s["out"] = torch.empty(rows + 5, n_out, device=DEV, dtype=BF16)
            s["grad_input"] = torch.empty(rows + 3, n_in, device=DEV, dtype=BF16)
        self.s = s
        self.load(seed + 1)

    def load(self, seed):
        """New values in the static inputs: x, dy, probs and splits (S = T, or below T: a padded
        tail) or logits (a new routing)."""
        g = torch.Generator(device=DEV).manual_seed(seed)
        with torch.no_grad():
            for name in ("x", "dy", "logits", "probs"):
                if name in self.s:
                    self.s[name].normal_(generator=g)
            if "probs" in self.s:
                self.s["probs"].abs_()
            if "splits" in self.s:
                self.s["splits"].copy_(splits(seed, T - (seed % 2) * 17))

    def input_names(self):
        """The leaves that get grads."""
        return [n for n in ("x", "logits", "probs") if n in self.s]

    def inputs(self):
        return [self.s[n] for n in self.input_names()]

    def forward(self, fn=None):
        fn = self.m if fn is None else fn
        s = self.s
        if self.op == "linear":
            return fn(s["x"], s["splits"], **self._buffers())
        if self.op == "mlp":
            return fn(s["x"], s["splits"], s["probs"], **self._buffers())
        return fn(s["x"], s["logits"])

    def _buffers(self):
        # detach(): after a call `out` is that call's output (autograd marked it), so a buffer used
        # again is passed as the same memory without that history, as the layer asks.
        return {n: self.s[n].detach() for n in ("out", "grad_input") if n in self.s}

    def backward(self, y):
        if self.op == "moe":
            (y.out.float() * self.s["dy"].float()).sum().add(y.score_sum.sum()).backward()
        else:
            y.backward(self.s["dy"])
        if self.variant == "delayed":
            self.m.backward_dw()

    def step(self, fn=None):
        y = self.forward(fn)
        self.backward(y)
        return y

    @staticmethod
    def detached(y):
        """A step's output without its autograd graph (which would keep the leaves' AccumulateGrad
        nodes, made on the capture's stream, alive into later eager steps)."""
        return type(y)(*(t.detach() for t in y)) if isinstance(y, tuple) else y.detach()

    def results(self, y):
        """What the step produced, by name (clones: a replay overwrites the graph's tensors)."""
        out = {"y": y.out if self.op == "moe" else y}
        if self.op == "moe":
            out["counts"] = y.counts
            out["score_sum"] = y.score_sum
        for n in self.input_names():
            out[f"{n}.grad"] = self.s[n].grad
        for name, p in self.m.named_parameters():
            if p.grad is not None:
                out[f"{name}.grad"] = p.grad
            if getattr(p, "main_grad", None) is not None:
                out[f"{name}.main_grad"] = p.main_grad
        if "grad_input" in self.s:
            out["grad_input buffer"] = self.s["grad_input"]
        return {k: v.detach().clone() for k, v in out.items() if v is not None}

    def reset(self, poison):
        """Before a step: main_grads zeroed (accumulated into), the grads poisoned with NaN
        (poison: a replay must rewrite them) or zeroed (an eager step accumulates into them), the
        dummy wgrads (a cached zero tensor autograd may have taken as .grad) zeroed. Caller
        buffers: zeroed, and poisoned in the rows below S (the library leaves the others as
        they are); an eager step's x.grad then None (below)."""
        for t in self.inputs():
            if t is self.s["x"] and "grad_input" in self.s and not poison:
                # A leaf x's .grad is the grad_input buffer's first rows (GroupedLinear.forward's
                # documented rule): the step writes dx there, so a zeroed x.grad would get dx
                # added to itself. An eager step starts without it, as that rule asks.
                t.grad = None
            else:
                fill(t.grad, zero=not poison)
        for p in self.params:
            fill(getattr(p, "main_grad", None), zero=True)
            fill(p.grad, zero=not poison or id(p) in self.dummies)
            if id(p) in self.dummies:
                p.grad_added_to_main_grad = False
        for n in ("out", "grad_input"):
            if n in self.s:
                fill(self.s[n], zero=True)
                if poison:
                    fill(self.s[n][:int(self.s["splits"].sum())], zero=False)

    def clear_grads(self):
        for t in self.inputs() + self.params:
            t.grad = None


class AttentionStep:
    """A training step of block_sparse_attention on static q, k, v, dout and document ids; the
    document-causal mask built on the device inside the step (graph: new boundaries every replay),
    or once outside it (make_graphed_callables, torch.compile: a fixed mask)."""

    def __init__(self, deterministic, build_inside=True):
        self.det, self.build_inside = deterministic, build_inside
        self.s = {n: torch.empty(1, H, S_ATTN, D, device=DEV, dtype=BF16, requires_grad=n != "do")
                  for n in ("q", "k", "v", "do")}
        self.s["doc"] = torch.zeros(1, S_ATTN, device=DEV, dtype=torch.int32)
        self.load(1)
        self.mask = None if build_inside else self._mask()

    def load(self, seed):
        g = torch.Generator(device=DEV).manual_seed(seed)
        with torch.no_grad():
            for n in ("q", "k", "v", "do"):
                self.s[n].normal_(generator=g)
            cuts = torch.randint(1, S_ATTN, (6 + seed % 3,), generator=torch.Generator().manual_seed(seed))
            self.s["doc"].copy_((torch.arange(S_ATTN)[None, :, None] >= cuts.sort().values).sum(-1).int())

    def _mask(self):
        return st.BlockMask.build("document_causal", S_ATTN, document_ids=self.s["doc"], schedule="shortest_first",
                                  device=DEV)

    def attention(self, q, k, v):
        mask = self._mask() if self.build_inside else self.mask
        return stt.block_sparse_attention(q, k, v, mask, deterministic=self.det)

    def inputs(self):
        return [self.s[n] for n in ("q", "k", "v")]

    def forward(self, fn=None):
        return (self.attention if fn is None else fn)(*self.inputs())

    def step(self, fn=None):
        o = self.forward(fn)
        o.backward(self.s["do"])
        return o

    detached = staticmethod(LayerStep.detached)

    def results(self, o):
        out = {"o": o, **{f"{n}.grad": self.s[n].grad for n in ("q", "k", "v")}}
        return {k: v.detach().clone() for k, v in out.items()}

    def reset(self, poison):
        for t in self.inputs():
            fill(t.grad, zero=not poison)

    def clear_grads(self):
        for t in self.inputs():
            t.grad = None


def saved_for_backward(fn):
    """fn()'s result and what autograd saved for its backward, as a list of (dtype, shape): every
    tensor a node saved, a parameter's or an input's included (the same list for two calls that
    save the same things, whatever the allocator does with them)."""
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        return fn(), saved


def assert_saves_fc1s_codes_instead(plain, saving, rows, fc1_columns):
    """What an FP8 MoELayer with fp8_saved_activations saved for backward (saved_for_backward's
    list) is what the plain FP8 layer saved with fc1's output, bf16 [rows, fc1_columns], replaced
    by its e4m3 codes (uint8, the same shape) and the empty tensor in the scales' place by the
    scales (fp32, one a row and 128 columns)."""
    fc1, no_scales = (torch.bfloat16, (rows, fc1_columns)), (torch.float32, (0,))
    codes, scales = (torch.uint8, (rows, fc1_columns)), (torch.float32, (rows * -(-fc1_columns // 128),))
    only_plain, only_saving = Counter(plain) - Counter(saving), Counter(saving) - Counter(plain)
    assert only_plain == Counter([fc1, no_scales]) and only_saving == Counter([codes, scales]), \
        f"saved only by the plain layer: {dict(only_plain)}; only with fp8_saved_activations: {dict(only_saving)}"
