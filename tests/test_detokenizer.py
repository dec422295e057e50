"""IncrementalDetokenizer: deltas concatenate to the one-shot decode, no split-character U+FFFD,
no stop-string leaks. Property tests with hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from steadyserve.engine.detokenizer import REPLACEMENT, IncrementalDetokenizer, text_decoder


def stream(tokenizer, ids: list[int], stop: list[str] | None = None) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tokenizer, stop or [])
    deltas = []
    for t in ids:
        deltas.append(d.add(t))
        if d.stopped:
            break
    deltas.append(d.finish())
    return deltas, d


def check_against_one_shot(tokenizer, ids: list[int]) -> None:
    deltas, _ = stream(tokenizer, ids)
    final = tokenizer.decode(ids, skip_special_tokens=True)
    pos = 0
    for i, delta in enumerate(deltas):
        # Every delta is exactly the final text at its place: so it never holds a U+FFFD (from a
        # multi-byte character split across tokens) that the one-shot decode does not have there.
        assert final[pos:pos + len(delta)] == delta, (
            f"delta {i} {delta!r} at {pos} differs from the one-shot decode {final!r} (ids {ids})")
        if REPLACEMENT in delta:
            assert final.count(REPLACEMENT) >= "".join(deltas[:i + 1]).count(REPLACEMENT)
        pos += len(delta)
    assert "".join(deltas) == final, f"ids {ids}"


# ---- the tiny byte-level BPE tokenizer ------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model)


def partial_ids(tokenizer) -> list[int]:
    """Tokens that are pieces of multi-byte characters (decode alone to U+FFFD)."""
    return [i for i in range(len(tokenizer)) if REPLACEMENT in tokenizer.decode([i])]


def id_lists(tokenizer, max_size: int = 40):
    partial = partial_ids(tokenizer)
    assert len(partial) >= 5, "the tokenizer should have byte pieces of multi-byte characters"
    ids = st.one_of(st.sampled_from(partial), st.integers(0, len(tokenizer) - 1))
    return st.lists(ids, max_size=max_size)


def test_tiny_tokenizer_multibyte_text_round_trips(tiny_tokenizer):
    text = "Überall façade naïve café — 日本語のテキスト, emoji 🙂🚀 steadyserve"
    ids = tiny_tokenizer.encode(text)
    assert any(REPLACEMENT in tiny_tokenizer.decode([i]) for i in ids), "test needs split characters"
    deltas, _ = stream(tiny_tokenizer, ids)
    assert "".join(deltas) == text
    assert all(REPLACEMENT not in d for d in deltas)


def test_tiny_tokenizer_random_ids(tiny_tokenizer):
    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(id_lists(tiny_tokenizer))
    def prop(ids):
        check_against_one_shot(tiny_tokenizer, ids)

    prop()


def test_the_direct_decode_is_transformers_decode(tiny_tokenizer):
    """text_decoder calls the fast tokenizer's backend directly: the same text as transformers' decode with the
    detokenizer's flags, special tokens (skipped), split characters and empty lists included; a tokenizer that
    overrides decode keeps its own."""
    decode = text_decoder(tiny_tokenizer)
    assert decode is not None and "backend" in decode.__code__.co_freevars  # the direct path on this tokenizer
    special = list(tiny_tokenizer.all_special_ids)
    assert special, "test needs special tokens"

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.one_of(st.sampled_from(special), st.integers(0, len(tiny_tokenizer) - 1)), max_size=20))
    def prop(ids):
        assert decode(ids) == tiny_tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    prop()

    class Overriding(type(tiny_tokenizer)):
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return "own"

    own = object.__new__(Overriding)
    own.__dict__.update(tiny_tokenizer.__dict__)
    assert text_decoder(own)([1, 2]) == "own"


# ---- SmolLM2's tokenizer ---------------------------------------------------------------------

@pytest.mark.smollm2
def test_smollm2_tokenizer_random_ids(smollm2):
    tok = smollm2.loaded.tokenizer
    text = "Café naïve — 日本語のテキスト 🙂🚀 ok"
    deltas, _ = stream(tok, tok.encode(text))
    assert "".join(deltas) == text and all(REPLACEMENT not in d for d in deltas)
    partial = [i for i in range(0, len(tok), 7) if REPLACEMENT in tok.decode([i])]

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.one_of(st.sampled_from(partial), st.integers(0, len(tok) - 1)), max_size=30))
    def prop(ids):
        check_against_one_shot(tok, ids)

    prop()


# ---- stop strings, with a tokenizer whose pieces do not line up with the stops ---------------

class PieceTokenizer:
    """A toy tokenizer: id -> fixed string; id 0 is a special token (decodes to nothing)."""

    PIECES = ["<s>", "a", "b", "c", "ab", "ba", "abc", " ", "x", "ca"]

    def __len__(self) -> int:
        return len(self.PIECES)

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) -> str:
        return "".join(self.PIECES[i] for i in ids if not (skip_special_tokens and i == 0))


def reference_stop(tok: PieceTokenizer, ids: list[int], stops: list[str]) -> tuple[str, bool]:
    """Stop at the first token after which some stop string occurs; cut at its earliest start."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return text[:min(hits)], True
    return tok.decode(ids), False


@settings(max_examples=500, deadline=None)
@given(st.lists(st.integers(0, len(PieceTokenizer.PIECES) - 1), max_size=30),
       st.lists(st.text(alphabet="abcx ", min_size=1, max_size=4), min_size=1, max_size=3))
def test_stop_strings_never_leak(ids, stops):
    tok = PieceTokenizer()
    d = IncrementalDetokenizer(tok, stops)
    expected, should_stop = reference_stop(tok, ids, stops)
    sent = ""
    for t in ids:
        sent += d.add(t)
        # What was streamed is always a prefix of the final text: no partial stop match escapes.
        assert expected.startswith(sent), (sent, expected)
        if d.stopped:
            break
    sent += d.finish()
    assert sent == expected
    assert d.stopped == should_stop
    for s in stops:
        assert s not in sent


def test_stop_string_split_across_tokens_is_held_then_released():
    tok = PieceTokenizer()
    d = IncrementalDetokenizer(tok, ["abc"])
    assert d.add(8) == "x"
    assert d.add(4) == ""  # "ab" could still become "abc": held back
    assert d.add(1) == "ab"  # "aba": "ab" cannot start a match any more; "a" still could
    assert d.add(4) == "a"  # "xabaab": the trailing "ab" is held, the "a" before it is not
    assert d.add(3) == "" and d.stopped  # "xabaabc": stop; nothing of "ab" is sent
    assert d.finish() == ""
    assert d.text == "xaba"
    d2 = IncrementalDetokenizer(tok, ["abc"])
    out = "".join(d2.add(t) for t in (8, 4)) + d2.finish()
    assert out == "xab" and not d2.stopped  # ended without a match: the held text is released
