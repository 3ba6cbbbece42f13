"""Readable token labels for display, outside every cache key: a label never changes a number."""

from __future__ import annotations

__all__ = ["token_labels"]

_CONTINUATION = "+"  # label prefix of a token that carries more bytes of the character before it


def token_labels(tokenizer, text_or_ids, *, add_special_tokens: bool = True) -> list[str]:
    """One readable label per token, so multi-byte characters (emoji, CJK) show instead of ``\ufffd``.

    With a text and a fast tokenizer the labels are the text's characters at the token offsets
    (special tokens show their name); given ids or a slow tokenizer, runs of tokens are decoded together
    until they end on a whole character. Tokens continuing a split character show it after ``+``."""
    if isinstance(text_or_ids, str):
        text = text_or_ids
        if getattr(tokenizer, "is_fast", False):
            encoded = tokenizer(text, return_offsets_mapping=True, add_special_tokens=add_special_tokens)
            return _labels_from_offsets(tokenizer, text, encoded["input_ids"], encoded["offset_mapping"])
        ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    else:
        ids = text_or_ids.tolist() if hasattr(text_or_ids, "tolist") else list(text_or_ids)
        if ids and isinstance(ids[0], list):
            if len(ids) != 1:
                raise ValueError(f"token_labels takes one sequence, got a batch of {len(ids)}")
            ids = ids[0]
    return _labels_from_ids(tokenizer, [int(i) for i in ids])


def _labels_from_offsets(tokenizer, text: str, ids, offsets) -> list[str]:
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    labels, covered = [], 0
    for token, (start, end) in zip(ids, offsets):
        if end <= start:  # special tokens (and tokens that stand for no text)
            labels.append(tokenizer.convert_ids_to_tokens(int(token)) if token in special
                          else tokenizer.decode([int(token)]))
        elif start < covered:  # more bytes of a character an earlier token began
            labels.append(_CONTINUATION + (text[start:end].strip() or text[start:end]))  # NBSP stays itself
        else:
            labels.append(text[start:end])
        covered = max(covered, end)
    return labels


def _labels_from_ids(tokenizer, ids: list[int]) -> list[str]:
    labels: list[str] = []
    start = 0
    for i in range(len(ids)):
        piece = tokenizer.decode(ids[start:i + 1])
        # an unfinished UTF-8 character (<= 4 bytes) decodes as U+FFFD until its last byte: the next token's bytes
        # join it (decoding the two together differs from decoding each); a U+FFFD of the text itself is whole
        if piece.endswith("\ufffd") and i + 1 < len(ids) and i - start < 3 and \
                tokenizer.decode(ids[start:i + 2]) != piece + tokenizer.decode(ids[i + 1:i + 2]):
            continue
        labels.append(piece)
        labels += [_CONTINUATION + (piece.strip() or piece)] * (i - start)
        start = i + 1
    return labels
