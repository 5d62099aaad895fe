"""Upstream's grammar sampler (``llama_sampler_init_grammar``) over the target's
vocabulary: the constraint of structured output.

Why upstream's: its parser and its per-token check (a token is allowed when some grammar
stack accepts its UTF-8 piece; EOG only once the grammar is complete) are what llama.cpp
serves, so a constrained response here is one llama-server could give. Used as a filter
only: `Grammar.allows` and `Grammar.allowed` apply the sampler to a token list and read
which logits it left finite; `Sampler.pick` masks the target's logits with that before its
position-keyed draw (greedy: the argmax first, the whole vocabulary only when the grammar
forbids it, as upstream's common sampler does).

Upstream aborts the process on a token its grammar forbids (GGML_ABORT on EOG, a C++
throw through the C API otherwise), so `Grammar.accept` checks first; a grammar that does
not parse gives NULL and its reason on stderr, read back here into one InputError line.

Speculation (`SessionGrammar`): the committed state advances by accepted tokens only. A
step's drafts are checked against clones before the verify decode (`cut`): the first one
the grammar forbids ends the draft there, so it costs no verify row, and the clone after
each allowed draft is the state of the pick at the next window position (the committed
tokens plus the drafts before it: the history exactly when that pick is emitted).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator, Sequence

import numpy as np

from mtplib.errors import InputError
from mtplib.runtime.lib import LOG_TAIL, load
from mtplib.runtime.model import RuntimeInputError
from mtplib.runtime.structured import GrammarSpec

log = logging.getLogger(__name__)

#: upstream's llama_token_data: {int32 id; float logit; float p}
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
#: the most candidates `Grammar.allowed_among` checks in one call
MAX_CANDIDATES = 256
_stderr_lock = threading.Lock()
_PARSE = re.compile(r"error parsing grammar: ([^\n]*)")


@contextlib.contextmanager
def _stderr_to(out: list[str]) -> Iterator[None]:
    """Upstream's parser prints its reason with fprintf(stderr): fd 2 goes to a file for
    the call; what else landed there is written back to stderr."""
    with _stderr_lock, tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        try:
            saved = os.dup(2)
        except OSError:  # no stderr at all (a detached process): nothing to read back
            yield
            return
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read().decode("utf-8", "replace"))


def _init(llama, vocab, spec: GrammarSpec):
    """A grammar sampler for ``spec`` (NULL vocab: parse only), or InputError with
    upstream's reason."""
    captured: list[str] = []
    with _stderr_to(captured):
        ptr = llama.llama_sampler_init_grammar(vocab, spec.gbnf.encode("utf-8"),
                                               spec.root.encode("utf-8"))
    text = "".join(captured)
    m = _PARSE.search(text)
    # the parser's message runs to the end (it echoes the grammar): what came before it
    # was someone else's
    before = text if m is None else text[: text.rfind("\n", 0, m.start()) + 1]
    if before.strip():
        sys.stderr.write(before)
    if ptr:
        return ptr
    if m:
        reason = m.group(1).strip()
        if reason.endswith(" at"):  # the parser names the rest of the text: none is left
            reason += " the end of the grammar"
    else:  # init's own checks log through upstream's logger, after the parse
        lines = [s.strip() for s in list(LOG_TAIL)[-4:]
                 if "left recursion" in s or "does not contain" in s or "undefined rule" in s]
        reason = lines[-1] if lines else "upstream refused it"
    if len(reason) > 160:
        reason = reason[:157] + "..."
    raise InputError(f"{spec.source}: invalid grammar: {reason or 'does not parse'}")


def check_grammar(spec: GrammarSpec) -> None:
    """Parse ``spec`` with upstream's parser now, before any model work (no vocabulary:
    a grammar naming tokens by their text, <|...|>, is checked when a session opens)."""
    llama, _ = load()
    try:
        ptr = _init(llama, None, spec)
    except InputError as e:
        if "no vocab to parse token" in str(e):
            return
        raise
    llama.llama_sampler_free(ptr)


class _Buffers:
    """Token lists handed to upstream: the whole vocabulary (ids 0..n-1), one token, and
    up to `MAX_CANDIDATES` candidates."""

    def __init__(self, llama, n_vocab: int) -> None:
        self.llama = llama
        self.full = np.zeros(n_vocab, dtype=TOKEN_DATA)
        self.full["id"] = np.arange(n_vocab, dtype=np.int32)
        self.one = np.zeros(1, dtype=TOKEN_DATA)
        self.some = np.zeros(MAX_CANDIDATES, dtype=TOKEN_DATA)
        self.full_arr = self._array(self.full)
        self.one_arr = self._array(self.one)
        self.some_arr = self._array(self.some)

    def _array(self, a: np.ndarray):
        p = ctypes.cast(a.ctypes.data, self.llama.llama_token_data_p)
        return self.llama.llama_token_data_array(data=p, size=len(a), selected=-1,
                                                 sorted=False)


class Grammar:
    """One grammar sampler state (upstream's llama_sampler); freed by `close`, or when
    collected."""

    def __init__(self, llama, ptr, vocab, bufs: _Buffers, stats: dict) -> None:
        self.llama, self.ptr, self.vocab, self.bufs, self.stats = llama, ptr, vocab, bufs, stats
        self._free = weakref.finalize(self, llama.llama_sampler_free, ptr)

    @classmethod
    def open(cls, spec: GrammarSpec, model) -> Grammar:
        """The start state of ``spec`` over ``model``'s vocabulary (a loaded `Model`)."""
        if not getattr(model, "ptr", None):
            raise RuntimeInputError(f"model {model.path} is closed")
        ptr = _init(model.llama, model.vocab, spec)
        return cls(model.llama, ptr, model.vocab, _Buffers(model.llama, model.n_vocab),
                   {"masks": 0, "checks": 0, "s": 0.0})

    def _live(self) -> None:
        if not self._free.alive:
            raise RuntimeInputError("this grammar state is closed")

    def allows(self, token: int) -> bool:
        """Whether the grammar accepts ``token`` next (one token's check)."""
        self._live()
        t0 = time.perf_counter()
        b = self.bufs
        b.one[0] = (token, 0.0, 0.0)
        b.one_arr.size = 1
        self.llama.llama_sampler_apply(self.ptr, ctypes.byref(b.one_arr))
        self.stats["checks"] += 1
        self.stats["s"] += time.perf_counter() - t0
        return bool(np.isfinite(b.one["logit"][0]))

    def allowed_among(self, ids: Sequence[int]) -> np.ndarray:
        """Which of ``ids`` (at most `MAX_CANDIDATES`) the grammar accepts next: a greedy
        pick whose argmax is forbidden checks its best candidates before the whole
        vocabulary (a 100k-150k vocabulary's whole check costs tens of ms)."""
        self._live()
        n = len(ids)
        if n > MAX_CANDIDATES:
            raise RuntimeInputError(f"{n} candidates: at most {MAX_CANDIDATES} at once")
        t0 = time.perf_counter()
        b = self.bufs
        b.some["id"][:n] = ids
        b.some["logit"][:n] = 0.0
        b.some_arr.size = n
        self.llama.llama_sampler_apply(self.ptr, ctypes.byref(b.some_arr))
        self.stats["checks"] += 1
        self.stats["s"] += time.perf_counter() - t0
        return np.isfinite(b.some["logit"][:n])

    def allowed(self) -> np.ndarray:
        """Which tokens of the whole vocabulary the grammar accepts next (a bool mask)."""
        self._live()
        t0 = time.perf_counter()
        b = self.bufs
        b.full["logit"] = 0.0
        b.full_arr.size = len(b.full)
        self.llama.llama_sampler_apply(self.ptr, ctypes.byref(b.full_arr))
        self.stats["masks"] += 1
        self.stats["s"] += time.perf_counter() - t0
        return np.isfinite(b.full["logit"])

    def is_eog(self, token: int) -> bool:
        return bool(self.llama.llama_vocab_is_eog(self.vocab, int(token)))

    def accept(self, token: int) -> None:
        """Advance by ``token``; refused (never sent to upstream, which would abort) when
        the grammar forbids it."""
        if not self.allows(token):
            raise RuntimeInputError(f"token {token} is not allowed by the grammar here")
        self.llama.llama_sampler_accept(self.ptr, int(token))

    def clone(self) -> Grammar:
        self._live()
        ptr = self.llama.llama_sampler_clone(self.ptr)
        if not ptr:
            raise RuntimeInputError("upstream could not copy the grammar state")
        return Grammar(self.llama, ptr, self.vocab, self.bufs, self.stats)

    def close(self) -> None:
        self._free()


class SessionGrammar:
    """One sequence's constraint: the committed state, the step's window states, and where
    the response ended (the first EOG the grammar allowed)."""

    def __init__(self, spec: GrammarSpec, model) -> None:
        self.spec, self.model = spec, model
        self.committed = Grammar.open(spec, model)
        self._window: list[Grammar] = []
        self._drafts: tuple[int, ...] = ()
        #: generated tokens committed so far, and the count through the first EOG (None:
        #: not ended)
        self.n_generated = 0
        self.end: int | None = None
        #: drafts the grammar cut before a verify (they cost no verify row)
        self.n_cut = 0

    @property
    def stats(self) -> dict:
        """Upstream grammar calls so far: whole-vocabulary masks, one-token checks, seconds."""
        return dict(self.committed.stats)

    def _drop_window(self) -> None:
        for g in self._window:
            g.close()
        self._window, self._drafts = [], ()

    def cut(self, drafts: Sequence[int]) -> list[int]:
        """The drafts up to the first one the grammar forbids; the states after each kept
        one are the window's for the verify."""
        self._drop_window()
        cur = self.committed
        for d in drafts:
            if not cur.allows(d):
                break
            cur = cur.clone()
            cur.accept(d)
            self._window.append(cur)
        kept = [int(d) for d in drafts[: len(self._window)]]
        self.n_cut += len(drafts) - len(kept)
        self._drafts = tuple(kept)
        return kept

    def window(self, drafts: Sequence[int]) -> list[Grammar]:
        """The state of each pick of a verify window [last, *drafts] (k+1 of them): the
        committed one, then after each draft. Drafts that did not go through `cut` are
        checked now; one the grammar forbids is refused."""
        if tuple(drafts) != self._drafts:
            kept = self.cut(drafts)
            if len(kept) < len(drafts):
                raise RuntimeInputError(f"draft {len(kept)} ({drafts[len(kept)]}) is not "
                                        "allowed by the grammar: cut the drafts first")
        return [self.committed, *self._window]

    def commit(self, tokens: Sequence[int]) -> None:
        """The committed state advances by the emitted tokens (accepted drafts and the
        target's pick); the window is dropped."""
        self._drop_window()
        for i, t in enumerate(tokens):
            self.committed.accept(t)
            if self.end is None and self.committed.is_eog(t):
                self.end = self.n_generated + i + 1
        self.n_generated += len(tokens)

    def reset(self, generated: Sequence[int]) -> None:
        """Start over and accept ``generated`` (after a truncation)."""
        self._drop_window()
        stats = self.committed.stats
        self.committed.close()
        self.committed = Grammar.open(self.spec, self.model)
        self.committed.stats.update(stats)
        self.n_generated, self.end = 0, None
        self.commit(generated)

    def close(self) -> None:
        self._drop_window()
        self.committed.close()
        s = self.committed.stats
        log.debug("grammar: %d masks, %d checks, %.4f s, %d drafts cut", s["masks"],
                  s["checks"], s["s"], self.n_cut)


def open_session_grammar(spec: GrammarSpec | None, target) -> SessionGrammar | None:
    """The constraint of a session on ``target`` (None without a grammar); a target whose
    model is not in this process (a ranged parent's context) is refused in one line."""
    if spec is None:
        return None
    model = getattr(target, "model", None)
    if model is None or not hasattr(model, "vocab"):
        raise RuntimeInputError("a grammar needs the target's vocabulary in this process: "
                                "run the constrained generation where the engine runs "
                                "(whole model, or RangedMTP's worker)")
    return SessionGrammar(spec, model)


def grammar_end(session) -> int | None:
    """Generated tokens through the EOG that ended a constrained session's response (None:
    unconstrained, or not ended)."""
    g = getattr(session, "grammar", None)
    return None if g is None else g.end
