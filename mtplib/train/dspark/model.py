"""A V4 DSpark draft in PyTorch, as upstream's `dflash.cpp` (graph_dsv4) computes it.

Written from ../shared/reference/v4-dspark.md and the pinned `src/models/dflash.cpp`:
* features: the frozen trunk's hc-mean of the residual entering each target layer
  (`deepseek4.cpp` build_hc_mean; `il == n_layer` is the last layer's output);
* injection (an embd batch): ``g = enc_norm(fc · f)``; per stage ``K = rope(kv_norm(wkv · g))``
  at the target positions, written to that stage's SWA K cache (no attention, no logits);
* the draft (a token batch): the block ``[anchor, mask × (n-1)]`` at positions pos0..,
  embedded with the target's `token_embd`, repeated into the hc streams, through the
  stages (hc_pre → attn_norm → MLA attention with one shared KV head and sinks → hc_post;
  hc_pre → ffn_norm → MoE with sqrt-softplus gating + shared expert → hc_post), the hc head,
  `output_norm` and the target's `output`. Attention is non-causal inside the block and
  reaches the injected K of earlier positions within the window (query q sees cell p iff
  q - p < n_swa; llama-kv-cache.cpp with non_causal_type ALL);
* Markov head: ``logits'(i) = logits(i) + w2 · w1[prev(i)]``, prev(0) = the anchor, prev(i) =
  argmax of slot i-1 upstream, the true token here when teacher forced;
* confidence head: ``c(i) = sigmoid(conf_proj · [h(i); w1[prev(i)]] + b)``, h the hc head's
  output before `output_norm`.

The V4 block math (hc pre/post with Sinkhorn, MoE, hc head, norms) is mtplib.train.model's:
`DSparkDraft` subclasses `V4Model` for those methods and keeps its own parameters, keyed by
their GGUF names (mtplib.model.dspark.spec's tensor table) with the numpy shape of the GGUF
tensor. Only the attention is its own.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mtplib.model.arch import HC, TensorSpec
from mtplib.model.dspark.spec import DSparkConfig, dspark_tensors, stage_config
from mtplib.train.model import V4Model, rms, rope_angles


def _key(name: str) -> str:
    return name.replace(".", "__")  # ParameterDict keys have no dots (as V4Model's)


def rope_at(x: torch.Tensor, theta: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """GPT-J RoPE on the last 2*theta.shape[-1] dims of x; theta broadcasts against
    x[..., :R/2] (per-row positions, unlike mtplib.train.model.rope's one position row)."""
    n_rot = 2 * theta.shape[-1]
    d = x.shape[-1]
    cos, sin = torch.cos(theta).to(x.dtype), torch.sin(theta).to(x.dtype)
    if inverse:
        sin = -sin
    xr = x[..., d - n_rot:].unflatten(-1, (n_rot // 2, 2))
    x0, x1 = xr[..., 0], xr[..., 1]
    y = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).flatten(-2)
    return torch.cat((x[..., : d - n_rot], y), -1)


def trunk_features(trunk: V4Model, tokens: torch.Tensor, layers) -> tuple[torch.Tensor,
                                                                        torch.Tensor]:
    """(features (B,T,len(layers)*E), trunk logits (B,T,V)) for tokens at 0..T-1.

    Feature ``il`` = hc-mean of the residual entering trunk layer ``il`` (il == n_layer:
    the last layer's output), as `llama_get_embeddings_layer_inp` returns it."""
    e = trunk.w("token_embd.weight")[tokens]
    X = e.unsqueeze(2).expand(-1, -1, HC, -1)
    inp = {}
    for l in range(trunk.cfg.n_layer):
        inp[l] = X
        X = trunk.block(X, l, 0, tokens, [])
    inp[trunk.cfg.n_layer] = X
    y = trunk.hc_head(X)
    logits = trunk.norm(y, "output_norm.weight") @ trunk.w("output.weight").T
    return torch.cat([inp[il].mean(2) for il in layers], -1), logits


class DSparkDraft(V4Model):
    """The draft's own tensors, keyed by GGUF name; `token_embd` / `output` are passed in
    (the frozen target's). Inherits V4Model's hc_pre / hc_post / hc_head / norm / moe."""

    def __init__(self, cfg: DSparkConfig, *, seed: int = 0, init: bool = True) -> None:
        nn.Module.__init__(self)
        self.dcfg = cfg
        self.cfg = stage_config(cfg)  # what the inherited V4 block math reads
        self.params = nn.ParameterDict()
        self.specs = {}
        g = torch.Generator().manual_seed(seed)
        for s in dspark_tensors(cfg):
            self.specs[s.name] = s
            shape = tuple(reversed(s.ne))
            t = self._init_draft(s, shape, g) if init else torch.zeros(shape)
            p = nn.Parameter(t)
            if s.kind == "exp_probs_b":  # moved by load balancing, not by gradients
                p.requires_grad_(False)
            self.params[_key(s.name)] = p

    def _init_draft(self, s: TensorSpec, shape, g) -> torch.Tensor:
        if s.block is not None or s.kind.startswith("output_hc_"):
            return self._init(s, shape, g)  # V4Model's init of the same kinds
        if s.kind.endswith("norm"):
            return torch.ones(shape)
        if s.kind == "fc":
            return torch.randn(shape, generator=g) / math.sqrt(s.ne[0])
        if s.kind == "markov_w1":
            return torch.randn(shape, generator=g) / math.sqrt(s.ne[0])
        return torch.zeros(shape)  # markov_w2, conf_proj: start as a plain DFlash draft

    def named_gguf(self) -> dict[str, torch.Tensor]:
        return {n: self.w(n) for n in self.specs}

    def load_gguf_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.specs if n not in tensors]
        if missing:
            raise ValueError(f"DSpark tensors missing: {missing[:5]}")
        with torch.no_grad():
            for n in self.specs:
                self.w(n).copy_(tensors[n].reshape(self.w(n).shape).to(self.w(n).dtype))

    # -- injection (an embd batch) ------------------------------------------------------------
    def inject(self, feats: torch.Tensor) -> list[torch.Tensor]:
        """feats (B, T, L*E) at positions 0..T-1 -> per stage the cached K rows (B, T, D)."""
        cfg = self.cfg
        g = self.norm(feats @ self.w("fc.weight").T, "enc.output_norm.weight")
        theta = rope_angles(torch.arange(feats.shape[1]), cfg.rope_dim, cfg.rope_freq_base)
        out = []
        for s in range(cfg.n_layer):
            kv = self.norm(g @ self.w(f"blk.{s}.attn_kv.weight").T,
                           f"blk.{s}.attn_kv_a_norm.weight")
            out.append(rope_at(kv, theta.to(kv.dtype)))
        return out

    # -- attention of the noise blocks ----------------------------------------------------
    def attention(self, x: torch.Tensor, l: int, kinj: torch.Tensor, anchors: torch.Tensor,
                  theta: torch.Tensor) -> torch.Tensor:
        """x (B*A, n, E) normed block inputs; block j of sequence b sits at anchors[j]..;
        kinj (B, T, D) the stage's injected K; theta (A, n, R/2) angles of the block rows."""
        cfg = self.cfg
        H, D, G, W = cfg.n_head, cfg.head_dim, cfg.o_groups, cfg.sliding_window
        B, T, _ = kinj.shape
        A, n = theta.shape[:2]
        p = f"blk.{l}."
        th = theta.unsqueeze(0).expand(B, -1, -1, -1).reshape(B * A, n, -1)
        qr = self.norm(x @ self.w(p + "attn_q_a.weight").T, p + "attn_q_a_norm.weight")
        q = rms((qr @ self.w(p + "attn_q_b.weight").T).view(B * A, n, H, D), cfg.rms_eps)
        q = rope_at(q, th.unsqueeze(2)).view(B, A, n, H, D)
        kb = self.norm(x @ self.w(p + "attn_kv.weight").T, p + "attn_kv_a_norm.weight")
        kb = rope_at(kb, th).view(B, A, n, D)
        # injected cell p is visible to block row i of anchor a iff p < a and a+i-p < W
        pos_q = anchors[:, None] + torch.arange(n)  # (A, n)
        cell = torch.arange(T)
        ok = (cell[None, None, :] < anchors[:, None, None]) & (
            pos_q[:, :, None] - cell[None, None, :] < W)
        m_inj = torch.zeros(A, n, T, dtype=x.dtype).masked_fill(~ok, -math.inf)
        scale = 1.0 / math.sqrt(D)
        s_inj = torch.einsum("baihd,bpd->bahip", q, kinj) * scale + m_inj[None, :, None]
        s_blk = torch.einsum("baihd,bakd->bahik", q, kb) * scale
        sink = self.w(p + "attn_sinks.weight").view(1, 1, H, 1, 1).expand(B, A, H, n, 1)
        P = torch.softmax(torch.cat((s_inj, s_blk, sink.to(s_inj.dtype)), -1), -1)
        o = (torch.einsum("bahip,bpd->baihd", P[..., :T], kinj)
             + torch.einsum("bahik,bakd->baihd", P[..., T:T + n], kb))
        o = rope_at(o.reshape(B * A, n, H, D), th.unsqueeze(2), inverse=True)
        o = o.reshape(B * A, n, G, H // G * D)
        woa = self.w(p + "attn_output_a.weight").view(G, cfg.o_lora, H // G * D)
        u = torch.einsum("btgi,gri->btgr", o, woa).reshape(B * A, n, G * cfg.o_lora)
        return u @ self.w(p + "attn_output_b.weight").T

    # -- the draft (a token batch) ---------------------------------------------------------
    def body(self, feats: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
             token_embd: torch.Tensor, output: torch.Tensor, n: int | None = None):
        """Blocks of ``n`` (default block_size) at every anchor of every sequence, up to the
        LM head (the Markov and confidence heads are `heads`).

        feats (B, T, L*E) at positions 0..T-1, tokens (B, T) the committed text (the anchor
        is tokens[:, a]), anchors (A,) positions (each >= 1; injected cells are < anchor).
        Returns (logits (B, A, n, V) before the Markov bias, h (B, A, n, E), expert loads).
        """
        cfg, dc = self.cfg, self.dcfg
        n = n or dc.block_size
        B, A = tokens.shape[0], anchors.shape[0]
        kinj = self.inject(feats)
        blk = torch.full((B, A, n), dc.mask_token_id, dtype=torch.int64)
        blk[:, :, 0] = tokens[:, anchors]
        pos = anchors[:, None] + torch.arange(n)
        theta = rope_angles(pos.reshape(-1), cfg.rope_dim, cfg.rope_freq_base)
        theta = theta.view(A, n, -1).to(feats.dtype)
        X = token_embd[blk].reshape(B * A, n, 1, cfg.n_embd).expand(-1, -1, HC, -1)
        loads = []
        for l in range(cfg.n_layer):
            Rs = X
            y, post, comb = self.hc_pre(X, f"blk.{l}.hc_attn")
            a = self.attention(self.norm(y, f"blk.{l}.attn_norm.weight"), l, kinj[l],
                               anchors, theta)
            X = self.hc_post(a, Rs, post, comb)
            Rs = X
            y, post, comb = self.hc_pre(X, f"blk.{l}.hc_ffn")
            f, load = self.moe(self.norm(y, f"blk.{l}.ffn_norm.weight"), l, None)
            loads.append(load)
            X = self.hc_post(f, Rs, post, comb)
        h = self.hc_head(X)  # before output_norm: the confidence head's input
        logits = self.norm(h, "output_norm.weight") @ output.T
        return logits.view(B, A, n, -1), h.view(B, A, n, -1), torch.stack(loads)

    def forward(self, *args, **kwargs):  # not V4Model's trunk + MTP pass
        return self.body(*args, **kwargs)

    def heads(self, logits: torch.Tensor, h: torch.Tensor, prev: torch.Tensor):
        """Markov bias and confidence logit for prev tokens ``prev`` (..., n):
        (logits + w2 · w1[prev], conf_proj · [h; w1[prev]] + b)."""
        w1p = self.w("markov_w1.weight")[prev]
        return logits + w1p @ self.w("markov_w2.weight").T, self.confidence(h, prev)

    def confidence(self, h: torch.Tensor, prev: torch.Tensor, *, detach: bool = False
                   ) -> torch.Tensor:
        """The confidence logit; ``detach`` keeps its loss off the Markov embedding."""
        w1p = self.w("markov_w1.weight")[prev]
        if detach:
            w1p = w1p.detach()
        feat = torch.cat((h, w1p), -1)
        return (feat @ self.w("conf_proj.weight").T + self.w("conf_proj.bias")).squeeze(-1)

    @torch.no_grad()
    def chain(self, feats, tokens, anchors, token_embd, output, n: int | None = None):
        """Upstream's greedy chain: prev(0) = anchor, prev(i) = argmax of slot i-1.
        Returns (logits' (B,A,n,V), confidences (B,A,n) after the sigmoid, drafts (B,A,n))."""
        logits, h, _ = self.body(feats, tokens, anchors, token_embd, output, n)
        prev = tokens[:, anchors]
        outs, confs = [], []
        for i in range(logits.shape[2]):
            o, c = self.heads(logits[:, :, i], h[:, :, i], prev)
            outs.append(o)
            confs.append(c)
            prev = o.argmax(-1)
        out = torch.stack(outs, 2)
        return out, torch.sigmoid(torch.stack(confs, 2)), out.argmax(-1)
