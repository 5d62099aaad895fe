"""DeepSeek-V4 forward pass and MTP block in PyTorch, exactly as upstream llama.cpp computes it.

Written from ../shared/reference/v4-graph-math.md (section numbers below) and checked
against upstream's logits (mtplib/train/parity.py). Parameters are keyed by their GGUF
names (``blk.2.attn_q_a.weight``) and have the numpy/torch shape of the GGUF tensor
(reversed ggml ``ne``), so export and import are plain copies. The MTP block's own hc head
(the sidecar's root ``output_hc_*``) is stored as ``mtp.output_hc_*``.

Differences from upstream that cannot change a result:
* the Hadamard rotations of q/K (they cancel exactly, §5);
* the indexer's top-k breaks ties by torch.topk order, not libstdc++ heap order (§12).
  With ``indexer_top_k`` >= the visible compressed rows (the trained config) every
  visible row is selected, so no tie can matter and training stays differentiable.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mtplib.model.arch import HC, V4Config, block_tensors, root_tensors

MTP_HEAD_PREFIX = "mtp."
NORM_EPS_W = 6.103515625e-5  # expert weight normalisation floor (lg:2148-2166)


def _key(name: str) -> str:
    return name.replace(".", "__")


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last axis (ggml_rms_norm)."""
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope_angles(pos: torch.Tensor, n_rot: int, base: float) -> torch.Tensor:
    """theta[t, i] as ggml_rope_cache_init computes it in float32: p * s^i, s = base^(-2/R),
    by repeated multiplication (ops.cpp), so angles match upstream bit for bit."""
    scale = torch.tensor(base, dtype=torch.float32).pow(-2.0 / n_rot)
    theta = pos.to(torch.float32)
    cols = []
    for _ in range(n_rot // 2):
        cols.append(theta)
        theta = theta * scale
    return torch.stack(cols, -1)  # (T, R/2)


def rope(x: torch.Tensor, theta: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """GPT-J (interleaved pairs) RoPE on the last R = 2*theta.shape[-1] dims of x.

    x: (B, T, ..., D); theta: (T, R/2). ``inverse`` rotates by -theta (ggml_rope_ext_back).
    """
    n_rot = 2 * theta.shape[-1]
    d = x.shape[-1]
    extra = x.dim() - 3  # dims between T and D
    th = theta.view(1, theta.shape[0], *([1] * extra), theta.shape[1])
    cos = torch.cos(th).to(x.dtype)
    sin = torch.sin(th).to(x.dtype)
    if inverse:
        sin = -sin
    xr = x[..., d - n_rot:].unflatten(-1, (n_rot // 2, 2))
    x0, x1 = xr[..., 0], xr[..., 1]
    y = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).flatten(-2)
    return torch.cat((x[..., : d - n_rot], y), -1)


def sinkhorn(c: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """c: (..., src, dst) -> doubly-stochastic-ish mixing (§3.1)."""
    c = torch.softmax(c, -1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def heap_select(v: list[float], k: int) -> list[int]:
    """The indices std::partial_sort(idx, idx+k, idx+n, v[a] > v[b]) leaves in front.

    A line-by-line port of libstdc++'s __heap_select (make_heap, then pop_heap for each
    later element that beats the heap top), which decides which of tied scores ggml's CPU
    top_k keeps (ops.cpp ggml_compute_forward_top_k_f32).
    """
    n = len(v)
    idx = list(range(n))
    if k >= n:
        return idx

    def comp(a: int, b: int) -> bool:
        return v[a] > v[b]

    def push_heap(hole: int, top: int, value: int) -> None:
        parent = (hole - 1) // 2
        while hole > top and comp(idx[parent], value):
            idx[hole] = idx[parent]
            hole = parent
            parent = (hole - 1) // 2
        idx[hole] = value

    def adjust_heap(hole: int, length: int, value: int) -> None:
        top = hole
        child = hole
        while child < (length - 1) // 2:
            child = 2 * (child + 1)
            if comp(idx[child], idx[child - 1]):
                child -= 1
            idx[hole] = idx[child]
            hole = child
        if (length & 1) == 0 and child == (length - 2) // 2:
            child = 2 * (child + 1)
            idx[hole] = idx[child - 1]
            hole = child - 1
        push_heap(hole, top, value)

    if k >= 2:  # make_heap(first, middle)
        parent = (k - 2) // 2
        while True:
            adjust_heap(parent, k, idx[parent])
            if parent == 0:
                break
            parent -= 1
    for i in range(k, n):
        if comp(idx[i], idx[0]):  # pop_heap(first, middle, i)
            value = idx[i]
            idx[i] = idx[0]
            adjust_heap(0, k, value)
    return idx[:k]


class V4Model(nn.Module):
    """Trunk + one MTP block of a `deepseek4` model, parameters keyed by GGUF name."""

    def __init__(self, cfg: V4Config, *, seed: int = 0, init: bool = True) -> None:
        super().__init__()
        cfg.validate()
        if cfg.n_mtp != 1:
            raise ValueError("exactly one MTP block is supported (as upstream)")
        self.cfg = cfg
        self.n_ubatch = 512  # upstream's ubatch size, for the indexer's exact tie order
        self.params = nn.ParameterDict()
        self.specs = {}
        g = torch.Generator().manual_seed(seed)
        specs = root_tensors(cfg)
        for i in range(cfg.n_blocks):
            specs += block_tensors(cfg, i)
        specs += [s.__class__(MTP_HEAD_PREFIX + s.name, s.ne, s.dtype, s.block, s.kind)
                  for s in root_tensors(cfg) if s.kind.startswith("output_hc_")]
        for s in specs:
            self.specs[s.name] = s
            shape = tuple(reversed(s.ne))
            if s.dtype == "I32":  # hash routing table: fixed token -> expert ids
                ids = torch.argsort(torch.rand(cfg.n_vocab, cfg.n_expert, generator=g), 1)
                self.register_buffer(_key(s.name), ids[:, : cfg.n_expert_used].to(torch.int64))
                continue
            t = torch.zeros(shape)
            if init:
                t = self._init(s, shape, g)
            p = nn.Parameter(t)
            if s.kind == "exp_probs_b":  # updated by load balancing, not by gradients
                p.requires_grad_(False)
            self.params[_key(s.name)] = p

    # -- parameters ---------------------------------------------------------------------
    def _init(self, s, shape, g) -> torch.Tensor:
        cfg, k = self.cfg, s.kind
        n_out_proj = 2 * (cfg.n_layer + 1)

        def normal(std: float) -> torch.Tensor:
            return torch.randn(shape, generator=g) * std

        if k == "token_embd":
            return normal(1.0)
        if k == "output":
            return normal(0.5 / math.sqrt(cfg.n_embd))
        if k.endswith("norm"):
            return torch.ones(shape)
        if k in ("attn_sinks", "exp_probs_b") or k.endswith("_ape"):
            return torch.zeros(shape)
        if k.endswith("_scale"):
            return torch.ones(shape)
        if k.endswith("_fn"):  # hc mixing: small, the bases decide at the start
            return normal(0.1 / math.sqrt(s.ne[0]))
        if k.endswith("_base"):
            t = normal(0.1)
            if k != "output_hc_base":  # comb part: lean towards the identity
                t[2 * HC:] += 2.0 * torch.eye(HC).reshape(-1)
            return t
        std = 1.0 / math.sqrt(s.ne[0])  # fan-in
        if k in ("attn_output_b", "ffn_down_exps", "ffn_down_shexp"):
            std /= math.sqrt(n_out_proj)
        return normal(std)

    def w(self, name: str) -> torch.Tensor:
        return self.params[_key(name)]

    def buf(self, name: str) -> torch.Tensor:
        return getattr(self, _key(name))

    def named_gguf(self) -> dict[str, torch.Tensor]:
        """Every tensor by GGUF name (the MTP head under ``mtp.output_hc_*``)."""
        out = {n: self.w(n) for n, s in self.specs.items() if s.dtype != "I32"}
        for n, s in self.specs.items():
            if s.dtype == "I32":
                out[n] = self.buf(n).to(torch.int32)
        return out

    def load_gguf_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for n, s in self.specs.items():
            t = tensors[n]
            if s.dtype == "I32":
                self.buf(n).copy_(t.to(torch.int64))
            else:
                with torch.no_grad():
                    self.w(n).copy_(t.to(self.w(n).dtype))

    # -- hyper-connections (§3, §9) --------------------------------------------------------
    def hc_pre(self, X: torch.Tensor, prefix: str):
        cfg = self.cfg
        fn, scale, base = (self.w(f"{prefix}_{p}.weight") for p in ("fn", "scale", "base"))
        B, T = X.shape[:2]
        mix = rms(X.reshape(B, T, HC * cfg.n_embd), cfg.rms_eps) @ fn.T  # (B,T,24)
        pre = torch.sigmoid(mix[..., :HC] * scale[0] + base[:HC]) + cfg.hc_eps
        post = 2 * torch.sigmoid(mix[..., HC:2 * HC] * scale[1] + base[HC:2 * HC])
        comb = (mix[..., 2 * HC:] * scale[2] + base[2 * HC:]).view(B, T, HC, HC)
        comb = sinkhorn(comb, cfg.hc_sinkhorn_iters, cfg.hc_eps)
        y = (pre.unsqueeze(-1) * X).sum(2)
        return y, post, comb

    @staticmethod
    def hc_post(f: torch.Tensor, Rs: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
        return post.unsqueeze(-1) * f.unsqueeze(2) + torch.einsum("btsd,btse->btde", comb, Rs)

    def hc_head(self, X: torch.Tensor, prefix: str = "") -> torch.Tensor:
        cfg = self.cfg
        fn = self.w(prefix + "output_hc_fn.weight")
        base = self.w(prefix + "output_hc_base.weight")
        scale = self.w(prefix + "output_hc_scale.weight")
        B, T = X.shape[:2]
        mix = rms(X.reshape(B, T, HC * cfg.n_embd), cfg.rms_eps) @ fn.T
        pre = torch.sigmoid(mix * scale[0] + base) + cfg.hc_eps
        return (pre.unsqueeze(-1) * X).sum(2)

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms(x, self.cfg.rms_eps) * self.w(name)

    # -- compressor (§6.2) ------------------------------------------------------------------
    def compress(self, x: torch.Tensor, l: int, which: str, ratio: int, d: int,
                 n_blocks: int) -> torch.Tensor:
        """Compressed rows c~_b (B, n_blocks, d) for blocks 0..n_blocks-1, sequence from 0."""
        cfg = self.cfg
        p = f"blk.{l}.{which}_compressor_"
        B = x.shape[0]
        n = n_blocks * ratio
        xs = x[:, :n]
        k = xs @ self.w(p + "kv.weight").T  # (B, n, c*d)
        ape = self.w(p + "ape.weight")  # (ratio, c*d)
        g = xs @ self.w(p + "gate.weight").T + ape.repeat(n_blocks, 1)
        k = k.view(B, n_blocks, ratio, -1)
        g = g.view(B, n_blocks, ratio, -1)
        if ratio == 4:  # overlap: prev block's first half + this block's second half
            kp = F.pad(k[:, :-1, :, :d], (0, 0, 0, 0, 1, 0))
            gp = F.pad(g[:, :-1, :, :d], (0, 0, 0, 0, 1, 0), value=-math.inf)
            k = torch.cat((kp, k[..., d:]), 2)
            g = torch.cat((gp, g[..., d:]), 2)
        c = (torch.softmax(g, 2) * k).sum(2)  # (B, n_blocks, d)
        c = self.norm(c, p + "norm.weight")
        pos = torch.arange(n_blocks) * ratio
        return rope(c, rope_angles(pos, cfg.rope_dim, cfg.compress_rope_freq_base))

    # -- attention (§5, §6) ---------------------------------------------------------------
    def attention(self, x: torch.Tensor, l: int, p0: int) -> torch.Tensor:
        """x (B, T, E) normed input at positions p0..p0+T-1."""
        cfg = self.cfg
        B, T, _ = x.shape
        pos = torch.arange(p0, p0 + T)
        H, D, G = cfg.n_head, cfg.head_dim, cfg.o_groups
        p = f"blk.{l}."
        ratio = cfg.compress_ratios[l]
        base = cfg.compress_rope_freq_base if ratio else cfg.rope_freq_base
        theta = rope_angles(pos, cfg.rope_dim, base)
        qr = self.norm(x @ self.w(p + "attn_q_a.weight").T, p + "attn_q_a_norm.weight")
        q = rms((qr @ self.w(p + "attn_q_b.weight").T).view(B, T, H, D), cfg.rms_eps)
        q = rope(q, theta)
        kv = self.norm(x @ self.w(p + "attn_kv.weight").T, p + "attn_kv_a_norm.weight")
        kv = rope(kv, theta)  # (B, T, D): one shared KV head, V = K
        dp = pos[:, None] - pos[None, :]
        mask = torch.zeros(T, T, dtype=x.dtype).masked_fill((dp < 0) | (dp >= cfg.sliding_window),
                                                              -math.inf)
        keys = kv
        n_blocks = (p0 + T) // ratio if ratio else 0
        if ratio and p0 != 0:
            raise ValueError("compressed layers need the sequence to start at position 0")
        if n_blocks > 0:
            comp = self.compress(x, l, "attn", ratio, D, n_blocks)
            blk = torch.arange(n_blocks)
            visible = blk[None, :] < torch.div(pos[:, None] + 1, ratio, rounding_mode="floor")
            if ratio == 4:
                visible = visible & self.indexer_select(x, qr, l, pos, n_blocks, visible)
            visible = visible.expand(B, T, n_blocks)
            cmask = torch.zeros(B, T, n_blocks, dtype=x.dtype).masked_fill(~visible, -math.inf)
            keys = torch.cat((kv, comp), 1)
            mask = torch.cat((mask.expand(B, T, T), cmask), 2)
        s = torch.einsum("bthd,bkd->bhtk", q, keys) / math.sqrt(D) + mask.unsqueeze(-3)
        sink = self.w(p + "attn_sinks.weight").view(1, H, 1, 1).expand(B, H, T, 1)
        P = torch.softmax(torch.cat((s, sink.to(s.dtype)), -1), -1)[..., :-1]
        o = torch.einsum("bhtk,bkd->bthd", P, keys)
        o = rope(o, theta, inverse=True)
        o = o.reshape(B, T, G, H // G * D)
        woa = self.w(p + "attn_output_a.weight").view(G, cfg.o_lora, H // G * D)
        u = torch.einsum("btgi,gri->btgr", o, woa).reshape(B, T, G * cfg.o_lora)
        return u @ self.w(p + "attn_output_b.weight").T

    def indexer_select(self, x, qr, l, pos, n_blocks, visible) -> torch.Tensor:
        """Lightning indexer (§6.4): which compressed rows each token may use."""
        cfg = self.cfg
        if cfg.indexer_top_k >= n_blocks:  # every visible row is selected: no scores needed
            return torch.ones_like(visible)
        B, T, _ = x.shape
        Hi, Di = cfg.indexer_heads, cfg.indexer_dim
        p = f"blk.{l}.indexer"
        qi = (qr @ self.w(p + ".attn_q_b.weight").T).view(B, T, Hi, Di)
        qi = rope(qi, rope_angles(pos, cfg.rope_dim, cfg.compress_rope_freq_base))
        wts = (x @ self.w(p + ".proj.weight").T) / math.sqrt(Di * Hi)
        ki = self.compress(x, l, "indexer", 4, Di, n_blocks)
        S = torch.einsum("bth,bthc->btc", wts, F.relu(torch.einsum("bthd,bcd->bthc", qi, ki)))
        S = S.masked_fill(~visible, -math.inf)
        if torch.is_grad_enabled():  # training: plain top-k (ties in torch's order)
            top = S.topk(cfg.indexer_top_k, -1).indices
            return torch.zeros_like(S, dtype=torch.bool).scatter(-1, top, True)
        # inference: upstream's selection, ties included, over the row width upstream uses:
        # the most rows visible to a token of the same ubatch, padded to a multiple of 256
        # (kvd:641); the sequence is decoded from position 0 in ubatches of self.n_ubatch
        sel = torch.zeros_like(S, dtype=torch.bool)
        for t in range(T):
            last = min(T, (t // self.n_ubatch + 1) * self.n_ubatch) - 1
            width = max(256, -(-(int(pos[last]) + 1) // 4 // 256) * 256)
            k = min(cfg.indexer_top_k, width)
            for b in range(B):
                row = S[b, t].float().tolist() + [-math.inf] * (width - n_blocks)  # f32
                keep = [i for i in heap_select(row, k) if i < n_blocks]
                sel[b, t, keep] = True
        return sel

    # -- MoE (§7) -------------------------------------------------------------------------
    def moe(self, h: torch.Tensor, l: int, tokens: torch.Tensor | None):
        """Routed experts + shared expert; returns (output, expert load counts)."""
        cfg = self.cfg
        n, Fe, E = cfg.n_expert, cfg.n_ff_exp, cfg.n_embd
        p = f"blk.{l}."
        lam = cfg.swiglu_clamp
        logits = h @ self.w(p + "ffn_gate_inp.weight").T
        probs = torch.sqrt(F.softplus(logits))
        if l < cfg.n_hash_layers:
            sel = self.buf(p + "ffn_gate_tid2eid.weight")[tokens]
        else:
            bias = self.w(p + "exp_probs_b.bias")
            sel = torch.topk(probs + bias, cfg.n_expert_used, -1).indices
        wts = probs.gather(-1, sel)
        if cfg.expert_weights_norm:
            wts = wts / wts.sum(-1, keepdim=True).clamp_min(NORM_EPS_W)
        if cfg.expert_weights_scale not in (0.0, 1.0):
            wts = wts * cfg.expert_weights_scale
        dense = torch.zeros_like(probs).scatter(-1, sel, wts)  # (B,T,n_exp)

        def swiglu(g, u):
            if lam > 1e-6:
                return F.silu(torch.clamp(g, max=lam)) * torch.clamp(u, -lam, lam)
            return F.silu(g) * u

        # every expert on every token (4 small experts: cheaper than gathering), the routing
        # weight folded in before the down projection: sum_i w_i D_i a_i = [D_i] [w_i a_i]
        wg = self.w(p + "ffn_gate_exps.weight").reshape(n * Fe, E)  # (n_exp, F, E) stacked
        wu = self.w(p + "ffn_up_exps.weight").reshape(n * Fe, E)
        wd = self.w(p + "ffn_down_exps.weight").transpose(1, 2).reshape(n * Fe, E)
        a = swiglu(h @ wg.T, h @ wu.T).unflatten(-1, (n, Fe))
        routed = (a * dense.unsqueeze(-1)).flatten(-2) @ wd
        sh = swiglu(h @ self.w(p + "ffn_gate_shexp.weight").T,
                    h @ self.w(p + "ffn_up_shexp.weight").T) @ self.w(p + "ffn_down_shexp.weight").T
        load = torch.zeros(cfg.n_expert).scatter_add_(
            0, sel.reshape(-1), torch.ones(sel.numel())).detach()
        return routed + sh, load

    # -- blocks ---------------------------------------------------------------------------
    def block(self, X, l, p0, tokens, loads):
        Rs = X
        y, post, comb = self.hc_pre(X, f"blk.{l}.hc_attn")
        a = self.attention(self.norm(y, f"blk.{l}.attn_norm.weight"), l, p0)
        X = self.hc_post(a, Rs, post, comb)
        Rs = X
        y, post, comb = self.hc_pre(X, f"blk.{l}.hc_ffn")
        f, load = self.moe(self.norm(y, f"blk.{l}.ffn_norm.weight"), l, tokens)
        loads.append(load)
        return self.hc_post(f, Rs, post, comb)

    def trunk(self, tokens: torch.Tensor, loads: list | None = None):
        """tokens (B, T) at positions 0..T-1 -> (logits (B,T,V), h (B,T,hc,E))."""
        loads = [] if loads is None else loads
        e = self.w("token_embd.weight")[tokens]
        X = e.unsqueeze(2).expand(-1, -1, HC, -1)
        for l in range(self.cfg.n_layer):
            X = self.block(X, l, 0, tokens, loads)
        y = self.hc_head(X)
        logits = self.norm(y, "output_norm.weight") @ self.w("output.weight").T
        return logits, X

    def mtp(self, tokens: torch.Tensor, h: torch.Tensor, p0: int, loads: list | None = None):
        """MTP graph (§10): token x_p at position p with the trunk's h_{p-1}.

        tokens (B, T) at positions p0..p0+T-1, h (B, T, hc, E)
        -> (logits (B,T,V), h_nextn (B,T,hc,E)).
        """
        cfg = self.cfg
        loads = [] if loads is None else loads
        L = cfg.n_layer
        p = f"blk.{L}.nextn."
        e = self.norm(self.w("token_embd.weight")[tokens], p + "enorm.weight")
        hn = self.norm(h, p + "hnorm.weight")
        z = torch.cat((e.unsqueeze(2).expand_as(hn), hn), -1)  # embedding first
        X = z @ self.w(p + "eh_proj.weight").T
        X = self.block(X, L, p0, tokens, loads)
        y = self.hc_head(X, MTP_HEAD_PREFIX)
        logits = self.norm(y, p + "shared_head_norm.weight") @ self.w("output.weight").T
        return logits, X

    def forward(self, tokens: torch.Tensor):
        """Trunk on tokens (B, T) and MTP on (tokens[:, 1:], h[:, :-1]) at positions 1..T-1.

        Returns (trunk logits (B,T,V), MTP logits (B,T-1,V), expert loads (n_blocks, n_exp));
        MTP row j predicts the token at position j+2 (DeepSeek's depth-1 MTP objective).
        """
        loads: list = []
        logits, X = self.trunk(tokens, loads)
        mtp_logits, _ = self.mtp(tokens[:, 1:], X[:, :-1], 1, loads)
        return logits, mtp_logits, torch.stack(loads)
