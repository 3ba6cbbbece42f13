"""The confirmatory registration: the sample, the family, the rule and every threshold of the
confirmatory replication, fixed on 2026-12-05 before a single confirmatory document was computed.

``book/preregistration.md`` ("Confirmatory registration") states in words what this module holds in
code; the page records :func:`constants_hash`, a SHA-256 of every constant that decides a confirmatory
verdict (:func:`constants`), and the hash of each confirmatory sample's document ids
(:func:`document_hash`). A test fails when the constants no longer hash to the registered value unless
the page lists a dated deviation that names the new hash.

The two samples
---------------
``exploratory``
    what the book computed before this registration: every sample of the evidence and default
    profiles is a prefix of the seed-0 permutation of a data set's documents
    (:func:`cwcore.data.document_blocks` and ``load_dataset(limit=..., seed=0)``; the furthest reaches
    position 82 of web text's permutation), and chapter 3's statistics read consecutive blocks from the
    data set's first documents (:func:`cwcore.data.lm_blocks`).
``confirmatory``
    64 documents per data set, one 128-token block each, drawn by :func:`cwcore.data.document_blocks`
    with seed :data:`CONFIRMATORY_SEED` from the documents outside :func:`exploratory_documents`: the
    first :data:`EXPLORATORY_PREFIX` positions of the seed-0 permutation and the first
    :data:`STREAM_DOCUMENTS` documents in data-set order. Disjoint from every exploratory sample by
    construction (and checked against every committed export by a test).
"""

from __future__ import annotations

import hashlib
import json
from typing import Sequence

import numpy as np

from . import ladder as evidence

__all__ = ["REGISTERED", "SAMPLES", "SEEN_BEFORE_REGISTRATION", "EXPLORATORY", "CONFIRMATORY", "EXPLORATORY_SEED", "EXPLORATORY_PREFIX",
           "STREAM_DOCUMENTS", "CONFIRMATORY_SEED", "CONFIRMATORY_DOCUMENTS", "CONFIRMATORY_SEQ_LEN",
           "N_BOOTSTRAP", "SINK_RESAMPLES", "RANDOM_SEEDS", "MDE_LEVEL", "SINK_CLAIMS", "NEW_CONTROLS", "IN_DISTRIBUTION",
           "sample_of", "exploratory_documents", "confirmatory_blocks", "document_hash", "constants", "constants_hash"]

#: the registration's date (UTC): nothing of the confirmatory sample was computed before it
REGISTERED = "2026-12-05"
EXPLORATORY, CONFIRMATORY = "exploratory", "confirmatory"
#: the values of the ``sample`` column of ``findings.csv`` and of every export's JSON
SAMPLES = (EXPLORATORY, CONFIRMATORY)

#: the exploratory ladder cells (model, data set, protocol) computed and committed before the exploratory
#: registration of 2026-12-02 (22 of its 32 tests): for them it fixed the reading, not the outcome
SEEN_BEFORE_REGISTRATION = (("smollm2-135m", "gsm8k", "default"), ("smollm2-135m", "gsm8k", "per-head"),
                            ("smollm2-135m", "web-text", "default"), ("smollm2-135m", "web-text", "per-head"),
                            ("gemma3-270m", "gsm8k", "default"))

#: the seed of every exploratory sample's permutation (:func:`cwcore.data.document_blocks`)
EXPLORATORY_SEED = 0
#: positions of the seed-0 permutation left out of the confirmatory draw (every exploratory sample lies
#: in its first 83; 128 leaves room for a larger default book without touching the confirmatory sample)
EXPLORATORY_PREFIX = 128
#: documents in data-set order left out (chapter 3 reads consecutive blocks from the first documents:
#: at most 32 blocks of 128 tokens, fewer than 30 GSM8K problems and fewer web documents)
STREAM_DOCUMENTS = 64
#: the confirmatory draw: seed, documents per data set and block length
CONFIRMATORY_SEED = 20261205
CONFIRMATORY_DOCUMENTS = 64
CONFIRMATORY_SEQ_LEN = 128
CONFIRMATORY_DATA = ("gsm8k", "web-text")
CONFIRMATORY_MODELS = tuple(evidence.PRIMARY["models"])

#: bootstrap resamples of the ladder's intervals (the evidence profile's ``n_bootstrap``), their seed 0
N_BOOTSTRAP = 2000
#: bootstrap resamples of the sink claims' intervals (chapters 5-7's ``n_bootstrap``), seed 0
SINK_RESAMPLES = 1000
#: seeds of the random control (0, 1, 2), their spread in the random rung's interval
RANDOM_SEEDS = 3
#: the level of a primary row's smallest detectable effect (``mde``, 80% power): Holm's strictest level,
#: ALPHA over the family's 32 tests (it decides only "too small to decide", never a verdict)
MDE_LEVEL = evidence.ALPHA / 32

#: The confirmatory sink claims. Each is judged per model and data set on the confirmatory sample from
#: the named parts of its chapter's claims table (``key``: the part's key without its data set), each part
#: its 95% interval against ``threshold`` on ``side`` (:func:`cwcore.stats.verdict`). ``role`` is
#: ``main`` (what the claim says) or ``control`` (what must also hold for the main part to mean what the
#: claim says). A claim's verdict is :func:`cwcore.stats.combine_all` over all its parts, controls included:
#: it holds only when every part is measured and holds, is contradicted when any part is contradicted, is
#: not measured when any part is not, and is inconclusive otherwise. No multiplicity adjustment (the
#: primary family is the ladder's 32 tests); every part is reported beside the claim's verdict.
SINK_CLAIMS = (
    {"claim": "many heads are sink heads", "source": "book", "parts": (
        ("sink_eps_by_layer", 0.5, "above", "main"),)},
    {"claim": "sink driven by value geometry, tail by attention and alignment", "source": "paper", "parts": (
        ("sink_geometry_margin_by_layer", 0.0, "above", "main"),
        ("tail_alpha_share", 0.1, "above", "main"),
        ("tail_cosine_share", 0.1, "above", "main"),
        ("sink_geometry_minus_null", 0.0, "above", "control"))},
    {"claim": "anti-alignment", "source": "paper", "parts": (
        ("cos_semantic", 0.0, "below", "main"),
        ("contrast", 0.0, "below", "control"),
        ("cos_semantic_centred", 0.0, "below", "control"))},
    {"claim": "stronger sink, stronger anti-alignment", "source": "paper", "parts": (
        ("rho_semantic", 0.0, "below", "main"),)},
    {"claim": "the sink suppresses the output norm", "source": "paper", "parts": (
        ("shortened", 0.5, "above", "main"),)},
    {"claim": "convexity", "source": "paper", "parts": (
        ("share_vertex_inside", 0.5, "above", "main"),
        ("share_interior_minus_random_direction", 0.0, "above", "control"))},
    {"claim": "low-norm outputs collapse into the cone", "source": "paper", "parts": (
        ("dcos_sink_q1", 0.0, "above", "main"),
        ("dcos_sink_minus_control", 0.0, "above", "control"),
        ("dcos_sink_minus_mass", 0.0, "above", "control"),
        ("dcos_sink_minus_random_direction", 0.0, "above", "control"))},
    {"claim": "removing the sink raises perplexity", "source": "paper", "parts": (
        ("dlog_sink", 0.0, "above", "main"),
        ("dlog_sink_minus_control", 0.0, "above", "control"),
        ("dlog_sink_minus_mass", 0.0, "above", "control"))},
    {"claim": "noise from many weak tokens accumulates", "source": "paper", "parts": (
        ("drift_weak_q1", 0.0, "above", "main"),
        ("drift_null_q1", 0.0, "above", "control"))},
)

#: the controls registered here that the analyses did not compute before this date, with what they measure
NEW_CONTROLS = {
    "sink_geometry_minus_null": (
        "the decomposition's null baseline: the sink's geometry share (sink_geometry_margin_by_layer's "
        "statistic) minus the same statistic computed for one random non-sink key per query (seed 0), "
        "paired by layer, bootstrap over layers"),
    "share_interior_minus_random_direction": (
        "convexity's direction control: the share of fitted heads whose minimum is established inside "
        "(0, 1) minus the same share when each head's sink value is replaced by a vector of the same norm "
        "in a random direction (seed 0) and the outputs recomputed, paired over heads, bootstrap over heads; "
        "a short sink value of any direction gives an interior vertex, so only a positive difference credits "
        "the direction (anti-alignment)"),
}

#: the in-distribution removal (exploratory, never confirmatory): each removed term alpha_ij v~_j replaced
#: by alpha_ij times the head's mean projected value, estimated on other documents, instead of zero
IN_DISTRIBUTION = {"variant": "mean-value", "data": "gsm8k", "documents": 16, "models": CONFIRMATORY_MODELS,
                   "estimated_on": "the exploratory sample's documents", "sample": EXPLORATORY}


def sample_of(profile: str) -> str:
    """The sample a run of ``profile`` draws: :data:`CONFIRMATORY` for the confirmatory build's profile (of
    the same name), :data:`EXPLORATORY` for every profile of ``book/run.yml``."""
    return CONFIRMATORY if profile == CONFIRMATORY else EXPLORATORY


def exploratory_documents(n_rows: int) -> set[int]:
    """The row indices of a data set of ``n_rows`` documents that the confirmatory draw leaves out: the
    first :data:`EXPLORATORY_PREFIX` positions of the seed-0 permutation and the first
    :data:`STREAM_DOCUMENTS` rows."""
    prefix = np.random.default_rng(EXPLORATORY_SEED).permutation(int(n_rows))[:EXPLORATORY_PREFIX]
    return {int(i) for i in prefix} | set(range(min(STREAM_DOCUMENTS, int(n_rows))))


def confirmatory_blocks(data: str, tokenizer, *, n_documents: int = CONFIRMATORY_DOCUMENTS,
                        seq_len: int = CONFIRMATORY_SEQ_LEN):
    """The confirmatory sample of the packaged data set ``data`` for ``tokenizer``: a
    :func:`cwcore.data.document_blocks` data set (``input_ids``, ``attention_mask``, ``document``) of
    ``n_documents`` blocks of ``seq_len`` tokens, seed :data:`CONFIRMATORY_SEED`, never a document of
    :func:`exploratory_documents`. A smaller ``n_documents`` gives a prefix of the registered sample."""
    from cwcore.data import document_blocks, load_dataset

    dataset = load_dataset(data)
    return document_blocks(dataset, tokenizer, seq_len, n_documents, seed=CONFIRMATORY_SEED,
                           exclude=exploratory_documents(len(dataset)))


def document_hash(ids: Sequence[int]) -> str:
    """SHA-256 of a sample's document ids in draw order, written as ``"12,7,..."``."""
    return hashlib.sha256(",".join(str(int(i)) for i in ids).encode()).hexdigest()


def constants() -> dict:
    """Every constant that decides a confirmatory verdict, as plain JSON values: the primary family and
    its rule (:mod:`cwbook.ladder`), the ratio grids and protocols, the samples, the
    resamples and seeds, the sink analyses' thresholds and the sink claims with their controls."""
    from cwcore.sinks.decomposition import TAIL_MARGIN
    from cwcore.sinks.engine import EPS

    return json.loads(json.dumps({
        "primary": evidence.PRIMARY, "margins": evidence.MARGINS, "alpha": evidence.ALPHA,
        "n_permutations": evidence.N_PERMUTATIONS, "protocols": evidence.PROTOCOLS,
        "low_ratios": evidence.LOW_RATIOS, "paper_ratios": list(evidence.PAPER_RATIOS),
        "importances": evidence.IMPORTANCES, "n_bootstrap": N_BOOTSTRAP, "sink_resamples": SINK_RESAMPLES,
        "random_seeds": RANDOM_SEEDS, "mde_level": MDE_LEVEL,
        "sample": {"exploratory_seed": EXPLORATORY_SEED, "exploratory_prefix": EXPLORATORY_PREFIX,
                   "stream_documents": STREAM_DOCUMENTS, "seed": CONFIRMATORY_SEED,
                   "documents": CONFIRMATORY_DOCUMENTS, "seq_len": CONFIRMATORY_SEQ_LEN,
                   "data": CONFIRMATORY_DATA, "models": CONFIRMATORY_MODELS},
        "sink_eps": EPS.default, "tail_margin": TAIL_MARGIN, "sink_claims": SINK_CLAIMS,
        "new_controls": sorted(NEW_CONTROLS), "in_distribution": IN_DISTRIBUTION,
    }, sort_keys=True))


def constants_hash() -> str:
    """SHA-256 of :func:`constants` as canonical JSON (sorted keys, no spaces)."""
    text = json.dumps(constants(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
