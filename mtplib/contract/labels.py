"""The names results are reported under, defined once: step kinds, MTP placements, seams.

Every layer labels its steps (the time split, the shard bytes per step kind, the WAN waits)
and its placements with these. They are `enum.StrEnum`s: a member is its text, so JSON and
CSV files, dict keys and comparisons with the labels of files written before stay the same.
"""

from __future__ import annotations

import enum


class StepKind(enum.StrEnum):
    """One step of a generation: the label its time and its shard bytes are counted under."""

    PREFILL = "prefill"  # the prompt, in chunks
    DECODE = "decode"  # one token with no drafts (MTP off, or no draft fits): a plain step
    DRAFT = "draft"  # the MTP block proposes k tokens
    VERIFY = "verify"  # the target decodes the last token and k drafts in one batch
    FEED = "feed"  # the accepted rows go to the MTP block
    ROLLBACK = "rollback"  # rejected drafts leave the target's cache (or a checkpoint)


STEP_KINDS: tuple[StepKind, ...] = tuple(StepKind)
#: the decoding phase: every step after the prompt
DECODING_STEPS: tuple[StepKind, ...] = (StepKind.DECODE, StepKind.VERIFY, StepKind.DRAFT,
                                        StepKind.FEED, StepKind.ROLLBACK)
#: the parts a generation's time is split into (``time_s``): a plain step's decode counts
#: under verify (a verify of zero drafts), so MTP off and on split the same way
TIME_PARTS: tuple[StepKind, ...] = (StepKind.PREFILL, StepKind.DRAFT, StepKind.VERIFY,
                                    StepKind.FEED, StepKind.ROLLBACK)


class Placement(enum.StrEnum):
    """Where a ranged generation's MTP block runs."""

    TAIL = "tail"  # on the tail shard, next to the trunk's last layers
    CLIENT = "client"  # in the client process, next to the sampler


#: the placements as their texts (for messages and choices)
PLACEMENTS: tuple[str, ...] = tuple(p.value for p in Placement)


class Seam(enum.StrEnum):
    """How a ranged step's boundary values reach the next shard (patches/0007)."""

    STAR = "star"  # through the client: it waits once per shard and step
    RING = "ring"  # shard to shard over a peer link: the client waits once per step


#: the seams as their texts
SEAMS: tuple[str, ...] = tuple(s.value for s in Seam)
#: what a caller may ask for: "auto" (ring where every shard and this build speak it) is
#: resolved by the ranged runtime
SEAM_CHOICES: tuple[str, ...] = ("auto", *SEAMS)
#: what a caller may ask for: "auto" is resolved by the entry point
PLACEMENT_CHOICES: tuple[str, ...] = ("auto", *PLACEMENTS)
