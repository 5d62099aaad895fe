"""Structured output under speculation (issue 43, point 1, the runtime and `generate`): the
target's picks follow upstream's grammar sampler; a draft the grammar forbids ends the
draft before the verify; greedy tokens with MTP equal MTP off's under the same grammar;
a JSON schema's responses parse and validate; a bad grammar or schema is one line.

On the committed trained pair (its tokenizer is a real BPE of 2,048 tokens, EOG id 0),
with held-out stdlib prompts as the other trained-pair tests take them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from mtplib.errors import InputError
from mtplib.model.trained import trained_paths
from mtplib.runtime.structured import (
    MAX_GBNF_CHARS,
    MAX_GBNF_DEPTH,
    GrammarSpec,
    constraint_from_request,
    grammar_spec,
    schema_spec,
)

PAIR = trained_paths()
needs_pair = pytest.mark.skipif(not PAIR.exists(),
                                reason=f"trained pair not committed under {PAIR.trunk.parent}")

WORDS = ("yes", "no", "maybe", "true", "false")
FIVE = grammar_spec('root ::= ("yes" | "no" | "maybe" | "true" | "false")')
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["function", "class", "module"]},
        "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                 "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "kind", "n", "tags", "ok"],
    "additionalProperties": False,
}
N_PROMPTS, PROMPT_LEN = 16, 32
#: more than the schema's longest response in tokens (strings and arrays are bounded)
N_JSON = 160
KS = (0, 2, 3)
EOG = 0


# -- pure: the request forms, the spec's guards, the pick ---------------------------------
def test_request_forms_give_one_spec():
    assert constraint_from_request() is None
    assert constraint_from_request(grammar="", response_format={"type": "text"}) is None
    assert constraint_from_request(grammar='root ::= "a"').gbnf == 'root ::= "a"'
    obj = schema_spec({"type": "object"}).gbnf
    assert constraint_from_request(json_schema={}).gbnf == obj  # llama-server: any object
    assert constraint_from_request(response_format={"type": "json_object"}).gbnf == obj
    want = schema_spec(SCHEMA).gbnf
    forms = [
        {"json_schema": SCHEMA},  # llama-server's top-level field
        {"response_format": {"type": "json_object", "schema": SCHEMA}},  # llama-server's
        {"response_format": {"type": "json_schema",  # OpenAI's
                             "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
        {"response_format": {"type": "json_object"}, "json_schema": SCHEMA},
    ]
    for f in forms:
        spec = constraint_from_request(**f)
        assert spec is not None and spec.gbnf == want, f


@pytest.mark.parametrize("fields, says", [
    ({"grammar": 'root ::= "a"', "json_schema": {}}, "not both"),
    ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "not both"),
    ({"grammar": 3}, "GBNF string"),
    ({"json_schema": [1]}, "must be a JSON object"),
    ({"json_schema": "{bad"}, "not valid JSON"),
    ({"json_schema": {"type": "foo"}}, "Unrecognized schema"),
    ({"json_schema": {"$ref": "https://example.com/s.json"}}, "invalid schema"),
    ({"json_schema": {"properties": 3}}, "invalid schema"),
    ({"json_schema": {"type": "object", "properties": {"n": {"type": "integer",
                                                              "minimum": 0}}}},
     "$.properties.n.minimum is not supported"),
    ({"response_format": {"type": "xml"}}, "text, json_object or json_schema"),
    ({"response_format": "json"}, "response_format must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"strict": "yes"}}},
     "strict must be true or false"),
])
def test_bad_requests_are_one_line(fields, says):
    with pytest.raises(InputError) as e:
        constraint_from_request(**fields)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_property_named_like_a_bound_is_no_bound():
    spec = schema_spec({"type": "object", "properties": {"minimum": {"type": "string"}}})
    assert "minimum" in spec.gbnf


def test_a_schema_string_admits_no_control_character():
    """llama-cpp-python's port lets a raw newline into a string (invalid JSON); the rule
    in its place is upstream's at the pin."""
    char = [line for line in schema_spec({"type": "string"}).gbnf.splitlines()
            if line.startswith("char ::=")]
    assert char and r"\x00-\x1F" in char[0] and r"\x7F" in char[0]


@pytest.mark.parametrize("gbnf, says", [
    ("", "empty"),
    ('root ::= "a\0"', "NUL"),
    ("root ::= " + "(" * (MAX_GBNF_DEPTH + 1) + '"a"' + ")" * (MAX_GBNF_DEPTH + 1),
     "groups deep"),
    ('root ::= "' + "a" * MAX_GBNF_CHARS + '"', "characters"),
])
def test_the_spec_refuses_what_would_crash_or_mean_nothing(gbnf, says):
    with pytest.raises(InputError, match=says):
        GrammarSpec(gbnf)


def test_group_depth_skips_literals_classes_and_comments():
    from mtplib.runtime.structured import gbnf_depth

    assert gbnf_depth('root ::= "((((" [(((] # ((((\n x ::= ((a))') == 2


class _Only:
    """A constraint allowing a fixed set of tokens (counts whole-vocabulary masks)."""

    def __init__(self, allowed: set[int], n: int) -> None:
        self.mask = np.zeros(n, dtype=bool)
        self.mask[list(allowed)] = True
        self.masks = 0

    def allows(self, t: int) -> bool:
        return bool(self.mask[t])

    def allowed_among(self, ids) -> np.ndarray:
        return self.mask[np.asarray(ids)]

    def allowed(self) -> np.ndarray:
        self.masks += 1
        return self.mask


def test_a_constrained_pick_is_the_pick_of_the_masked_logits():
    from mtplib.runtime.sampling import GREEDY_CANDIDATES, Sampler

    rng = np.random.default_rng(0)
    masks = 0
    for trial in range(300):
        lg = rng.normal(size=300).astype(np.float32)
        lg[rng.integers(300)] = lg.max()  # ties at the top sometimes
        lg[rng.integers(300, size=40)] = np.round(lg[rng.integers(300)], 1)
        only = _Only(set(rng.choice(300, size=int(rng.integers(1, 12)),
                                    replace=False).tolist()), 300)
        masked = np.where(only.mask, lg, -np.inf)
        assert Sampler().pick(lg, constraint=only) == int(np.argmax(masked)), trial
        masks += only.masks
        s = Sampler(temperature=0.9, top_p=0.95, seed=3)
        want = s.pick(masked, stream=1, position=trial)
        assert s.pick(lg, stream=1, position=trial, constraint=only) == want
    assert 0 < masks < 300  # mostly answered from the best candidates
    # greedy: no whole-vocabulary mask while the argmax or a best candidate is allowed
    lg = np.arange(1000, dtype=np.float32)
    for allowed, want, n_masks in (({999, 2}, 999, 0), ({998 - GREEDY_CANDIDATES + 2, 3},
                                                        998 - GREEDY_CANDIDATES + 2, 0),
                                   ({2, 3}, 3, 1)):
        only = _Only(allowed, 1000)
        assert Sampler().pick(lg, constraint=only) == want and only.masks == n_masks
    only = _Only({2, 3}, 1000)
    with pytest.raises(InputError, match="allows no token"):
        Sampler(logit_bias=((2, -np.inf), (3, -np.inf))).pick(lg, constraint=only)


# -- on the trained pair --------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    from mtplib.runtime.model import Model

    with Model(PAIR.trunk) as m:
        yield m


@pytest.fixture(scope="module")
def prompts():
    from mtplib.lab.trained_eval import heldout_modules, heldout_tokens, prompts_from

    docs = heldout_tokens(PAIR.trunk, heldout_modules(PAIR.trunk.parent / "split.json"))
    return prompts_from(docs, n=N_PROMPTS, length=PROMPT_LEN, seed=0)


@pytest.fixture(scope="module")
def runs(prompts):
    """Greedy generations under the schema and the five-word grammar, and sampled ones,
    for each k: {k: {"json": [...], "five": [...], "sampled": [...]}}, each a list of
    (tokens, metrics, text)."""
    from mtplib.runtime.sampling import Sampler
    from mtplib.runtime.speculative import MTPRuntime

    schema = schema_spec(SCHEMA)
    out = {}
    for k in KS:
        with MTPRuntime(str(PAIR.trunk), str(PAIR.sidecar) if k else None, k=k, n_ctx=512,
                        n_threads=1) as rt:
            def gen(p, n, sampler, rt=rt):
                toks, m = rt.generate(p, n, sampler=sampler)
                return toks, m, rt.detokenize(toks)

            out[k] = {
                "json": [gen(p, N_JSON, Sampler(grammar=schema)) for p in prompts],
                "five": [gen(p, 12, Sampler(grammar=FIVE)) for p in prompts[:4]],
                "sampled": [gen(p, N_JSON, Sampler(temperature=0.7, seed=s, grammar=g))
                            for s, (p, g) in enumerate(
                                [(q, schema) for q in prompts[:3]]
                                + [(q, FIVE) for q in prompts[:3]])],
            }
    return out


@needs_pair
def test_the_five_word_grammar_enumerates_exactly_its_language(model):
    """Every token path upstream's grammar sampler allows on this tokenizer, walked to
    its EOG: the texts are exactly the five words (each spelt by every tokenization the
    vocabulary has), nothing else, and EOG comes only when a word is complete."""
    from mtplib.runtime.grammar import Grammar

    texts: set[str] = set()
    paths = 0

    def walk(g: Grammar, toks: list[int]) -> None:
        nonlocal paths
        allowed = np.flatnonzero(g.allowed())
        assert allowed.size, toks
        for t in allowed.tolist():
            if t == EOG:
                texts.add(model.detokenize(toks))
                paths += 1
                continue
            nxt = g.clone()
            nxt.accept(t)
            walk(nxt, [*toks, t])
            nxt.close()

    g = Grammar.open(FIVE, model)
    assert not g.allows(EOG)  # nothing complete yet: EOG is forbidden
    walk(g, [])
    g.close()
    assert texts == set(WORDS)
    assert paths > len(WORDS)  # several tokenizations of some words


@needs_pair
def test_a_forbidden_token_is_refused_never_sent_upstream(model):
    """Upstream aborts the process on a forbidden EOG and throws through the C API on
    another forbidden token: `accept` checks first."""
    from mtplib.runtime.grammar import Grammar
    from mtplib.runtime.model import RuntimeInputError

    g = Grammar.open(FIVE, model)
    for t in (EOG, model.tokenize("zebra")[0]):
        with pytest.raises(RuntimeInputError, match="not allowed by the grammar"):
            g.accept(t)
    for t in model.tokenize("yes"):
        g.accept(t)
    assert g.allows(EOG)
    g.accept(EOG)  # complete: EOG is accepted (and changes nothing)
    g.close()


@needs_pair
def test_a_token_named_grammar_is_checked_against_the_vocabulary(model):
    """Without a vocabulary (before the model loads) a token name cannot be checked; the
    session's open checks it."""
    from mtplib.runtime.grammar import Grammar, check_grammar

    spec = grammar_spec('root ::= <|nosuch|> "a"')
    check_grammar(spec)
    with pytest.raises(InputError, match=re.escape("invalid token '<|nosuch|>'")):
        Grammar.open(spec, model)
    g = Grammar.open(grammar_spec('root ::= <[5]> "a"'), model)
    assert np.flatnonzero(g.allowed()).tolist() == [5]
    g.close()


@needs_pair
def test_generations_under_the_grammar_are_in_its_language(runs):
    for k in KS:
        for toks, m, text in runs[k]["five"] + runs[k]["sampled"][3:]:
            assert text in WORDS and toks[-1] == EOG, (k, text)
            assert m.n_generated == len(toks) < 12  # ended at the EOG
    sampled = {text for _, _, text in runs[0]["sampled"][3:]}
    greedy = {text for _, _, text in runs[0]["five"]}
    assert sampled | greedy <= set(WORDS)


@needs_pair
def test_json_schema_responses_parse_and_validate(runs):
    import jsonschema

    assert len(runs[0]["json"]) >= 16
    for k in KS:
        for toks, _, text in runs[k]["json"] + runs[k]["sampled"][:3]:
            assert toks[-1] == EOG and len(toks) < N_JSON, (k, text)  # the response ended
            jsonschema.validate(json.loads(text), SCHEMA)


@needs_pair
@pytest.mark.parametrize("what", ["json", "five", "sampled"])
def test_tokens_with_mtp_equal_mtp_off_under_the_constraint(runs, what):
    """Greedy and sampled (position-keyed draws): MTP k=2,3 emit MTP off's tokens, and
    some drafts were verified (the constraint did not turn MTP off)."""
    ref = [t for t, _, _ in runs[0][what]]
    for k in KS[1:]:
        assert [t for t, _, _ in runs[k][what]] == ref, k
    if what == "json":
        assert sum(m.drafted for _, m, _ in runs[2][what]) > 0


class _Proposes:
    """A drafter proposing fixed token lists (by call), to put forbidden drafts in."""

    name = "fixed"
    needs_rows = False
    pad_single = False

    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts

    def prefill(self, *a) -> None: ...

    def propose(self, seq, last, base, k):
        return self.drafts[:k]

    def commit(self, *a) -> None: ...

    def truncate(self, *a) -> None: ...

    def propose_many(self, asks):
        return [self.propose(*a) for a in asks]

    def commit_many(self, feeds) -> None: ...


@needs_pair
def test_a_forbidden_draft_ends_the_draft_before_the_verify(model, prompts):
    """Drafts one allowed token then forbidden ones: the verify decodes [last, allowed]
    only; a first draft the grammar forbids makes the step a plain one (no verify row)."""
    from mtplib.runtime.engine import Engine
    from mtplib.runtime.model import Context, ContextConfig
    from mtplib.runtime.sampling import Sampler

    zebra = model.tokenize("zebra")[0]  # no word goes on with it, nor starts with it
    with Context(model, ContextConfig(n_ctx=256, n_threads=1)) as ctx:
        widths: list[int] = []
        decode = ctx.decode

        def counted(tokens, *a, **kw):
            widths.append(len(tokens))
            return decode(tokens, *a, **kw)

        ctx.decode = counted
        for first_allowed in (True, False):
            drafter = _Proposes([])
            e = Engine(ctx, drafter, k=3, sampler=Sampler(grammar=FIVE),
                       checkpoints="replay")
            s = e.open(prompts[0])  # its first token is picked under the grammar
            ok = int(np.flatnonzero(s.grammar.committed.allowed())[-1])
            drafter.drafts = [ok, zebra, zebra] if first_allowed else [zebra, ok, ok]
            widths.clear()
            s.step()
            assert widths[0] == (2 if first_allowed else 1)  # then a replay if rejected
            assert s.grammar.n_cut == (2 if first_allowed else 3)
            m = s.metrics
            assert (m.verify_steps, m.plain_steps) == ((1, 0) if first_allowed else (0, 1))
            assert m.drafted == (1 if first_allowed else 0)
            e.close(s)


@needs_pair
def test_a_bad_grammar_at_open_leaves_the_runtime_usable(prompts):
    from mtplib.runtime.sampling import Sampler
    from mtplib.runtime.speculative import MTPRuntime

    with MTPRuntime(str(PAIR.trunk), str(PAIR.sidecar), k=2, n_ctx=256, n_threads=1) as rt:
        for gbnf, says in (('root ::= ("yes" | "no"', "expecting ')'"),
                           ("root ::= foo", "Undefined rule identifier 'foo'"),
                           ('root ::= root "a"', "left recursion"),
                           ('main ::= "a"', "does not contain a 'root' symbol")):
            with pytest.raises(InputError) as e:
                rt.generate(prompts[0], 4, sampler=Sampler(grammar=grammar_spec(gbnf)))
            assert says in str(e.value) and "\n" not in str(e.value)
        toks, _ = rt.generate(prompts[0], 12, sampler=Sampler(grammar=FIVE))
        assert rt.detokenize(toks) in WORDS and not rt.engine.sessions


@needs_pair
def test_a_constrained_slot_beside_an_unconstrained_one_equals_each_alone(prompts):
    from mtplib.runtime.sampling import Sampler
    from mtplib.runtime.speculative import MTPRuntime

    schema = Sampler(grammar=schema_spec(SCHEMA))
    plain = Sampler()
    asks = [(prompts[0], N_JSON, schema), (prompts[1], 48, plain),
            (prompts[2], 12, Sampler(grammar=FIVE))]
    with MTPRuntime(str(PAIR.trunk), str(PAIR.sidecar), k=2, n_seq_max=4, n_ctx=1024,
                    n_threads=1) as rt:
        alone = [rt.generate(p, n, sampler=sm)[0] for p, n, sm in asks]
        b = rt.batch()
        joined = b.join_many(asks)
        slots = [q for q, _ in joined]
        streamed = {q: list(first) for q, first in joined}
        while b.active():
            for q, toks in b.step().items():
                streamed[q] += toks
        got = [b.leave(q)[0] for q in slots]
        b.close()
    assert got == alone
    assert [streamed[q] for q in slots] == alone  # nothing streamed past an EOG
    assert alone[0][-1] == EOG and len(alone[1]) == 48 and alone[2][-1] == EOG


@needs_pair
def test_ranged_generation_carries_the_grammar(prompts):
    """The grammar travels with the sampler to the ranged worker, which builds the state
    from its own vocabulary: the same tokens as the whole model."""
    from mtplib.distributed.ranged_mtp import RangedMTP
    from mtplib.runtime.engine_options import EngineOptions
    from mtplib.runtime.sampling import Sampler
    from mtplib.runtime.speculative import MTPRuntime

    sampler = Sampler(grammar=schema_spec(SCHEMA))
    opts = EngineOptions.build(k=2, n_ctx=256, n_threads=1)
    with MTPRuntime(str(PAIR.trunk), str(PAIR.sidecar), opts=opts) as rt:
        want = rt.generate(prompts[3], N_JSON, sampler=sampler)[0]
    with RangedMTP(str(PAIR.trunk), plan="0-1,2-3", sidecar=str(PAIR.sidecar),
                   opts=opts) as r:
        got = r.generate(prompts[3], N_JSON, sampler=sampler)[0]
    assert got == want and got[-1] == EOG


# -- the CLI ---------------------------------------------------------------------------
@needs_pair
def test_generate_json_schema_end_to_end(tmp_path, capsys):
    """`generate -j SCHEMA` in a process of its own, and `-jf FILE` here: the text parses
    and validates, the tokens end with the EOG."""
    import jsonschema

    from mtplib.cli import main

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    argv = ["generate", "-m", str(PAIR.trunk), "-md", str(PAIR.sidecar), "--draft", "2",
            "--prompt", "def parse(self, text):", "--n", str(N_JSON), "--ctx", "256",
            "--json"]
    r = subprocess.run([sys.executable, "-m", "mtplib.cli", *argv, "-j", json.dumps(SCHEMA)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert main([*argv, "-jf", str(schema_file)]) == 0
    here = capsys.readouterr().out
    for out in (json.loads(r.stdout), json.loads(here)):
        assert out["tokens"][-1] == EOG
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert json.loads(here)["tokens"] == json.loads(r.stdout)["tokens"]


@pytest.mark.parametrize("argv, says", [
    (["--grammar", 'root ::= ("yes" | "no"'], "--grammar: invalid grammar: expecting ')'"),
    (["--grammar", "root ::= foo"], "Undefined rule identifier 'foo'"),
    (["-j", '{"type": "foo"}'], "--json-schema: unsupported or invalid schema"),
    (["-j", "{"], "--json-schema: not valid JSON"),
    (["--grammar-file", "/no/such.gbnf"], "--grammar-file /no/such.gbnf: cannot read it"),
    (["--grammar", 'root ::= "a"', "-j", "{}"], "give one of --grammar"),
])
def test_generate_refuses_a_bad_grammar_in_one_line_before_loading(capsys, argv, says):
    from mtplib.cli import main

    assert main(["generate", "--model", "/no/such.gguf", "--tokens", "1", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
