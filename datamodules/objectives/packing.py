"""GPT packing: documents as one token stream, cut into fixed windows.

The store already ends every document with the end-of-text id (EOS), so a split's stream is its
documents' token spans laid end to end: `d0 EOS d1 EOS d2 EOS ...`. Window i covers stream
positions [i * T, i * T + T + 1): inputs are its first T tokens, targets its last T (the inputs
shifted by one). Windows overlap by one token, so no token is dropped except the final tail of
fewer than T + 1 tokens, and no padding is ever needed.

Document ids for document masking: an EOS *starts* a new segment (it plays the role of the next
document's beginning-of-sequence token). Then the last token of a document predicts EOS within
its own document, the EOS predicts the next document's first token within the new one, and no
prediction ever looks across a document boundary. Ids count segments from 0 within each window;
position ids restart at 0 at each segment (`models.gpt` derives the same positions from the ids).
"""

from __future__ import annotations

import numpy as np


class PackedStream:
    """A split's documents as one virtual token stream over the store (nothing is copied).

    Args:
        tokens: (N,) the store's token array (memory-mapped).
        doc_offsets: (D + 1,) the store's document offsets.
        documents: (M,) indices of the split's documents, in stream order.
    """

    def __init__(self, tokens: np.ndarray, doc_offsets: np.ndarray, documents: np.ndarray) -> None:
        documents = np.asarray(documents, dtype=np.int64)
        if len(documents) == 0:
            raise ValueError("a packed stream needs at least one document")
        offsets = np.asarray(doc_offsets)
        starts, stops = offsets[documents], offsets[documents + 1]
        # Merge documents that are adjacent in the store into runs: few pieces per read.
        new_run = np.ones(len(documents), dtype=bool)
        new_run[1:] = starts[1:] != stops[:-1]
        self.run_starts = starts[new_run]
        run_lengths = np.add.reduceat(stops - starts, np.flatnonzero(new_run))
        self.run_positions = np.concatenate([[0], np.cumsum(run_lengths)])  # stream offsets
        self.tokens = tokens

    def __len__(self) -> int:
        return int(self.run_positions[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Stream tokens [start, start + length) as a new int64 array."""
        out = np.empty(length, dtype=np.int64)
        run = int(np.searchsorted(self.run_positions, start, side="right")) - 1
        done = 0
        while done < length:
            offset = start + done - int(self.run_positions[run])
            take = min(length - done, int(self.run_positions[run + 1]) - (start + done))
            source = int(self.run_starts[run]) + offset
            out[done : done + take] = self.tokens[source : source + take]
            done += take
            run += 1
        return out

    def num_windows(self, seq_len: int) -> int:
        """Windows of seq_len inputs (+1 target) that fit in the stream."""
        return max(0, (len(self) - 1) // seq_len)

    def windows(self, indices: np.ndarray, seq_len: int) -> np.ndarray:
        """(B, seq_len + 1) tokens of windows `indices`."""
        return np.stack([self.read(int(i) * seq_len, seq_len + 1) for i in indices])


def document_ids(inputs: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Segment ids and positions of packed inputs.

    Args:
        inputs: (B, T) input ids.
        eos_id: the end-of-text id separating documents.

    Returns:
        doc_ids (B, T): segment of every token, counting from 0, +1 at every EOS.
        position_ids (B, T): position within the segment, 0 at each segment start.
    """
    is_eos = inputs == eos_id
    doc_ids = np.cumsum(is_eos, axis=1)
    doc_ids -= doc_ids[:, :1]  # a window that opens with EOS still counts from 0
    columns = np.broadcast_to(np.arange(inputs.shape[1]), inputs.shape)
    segment_start = np.maximum.accumulate(np.where(is_eos, columns, 0), axis=1)
    return doc_ids, columns - segment_start
