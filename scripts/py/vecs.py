"""What the comparison scripts share: reading the data's .fvecs / .ivecs files and recall@k."""

import numpy as np


def read_vecs(path, dtype):
    """The rows of an .fvecs (dtype float32) or .ivecs (int32) file, as one contiguous array."""
    raw = np.fromfile(path, dtype=np.int32)
    dim = raw[0]
    rows = raw.reshape(-1, dim + 1)[:, 1:]
    return np.ascontiguousarray(rows.view(dtype))


def recall(labels, truth, k=10):
    """Mean recall@k of the rows of `labels` against the first k ids of each row of `truth`."""
    found = sum(len(set(row[:k]) & set(t[:k])) for row, t in zip(labels, truth))
    return found / (len(labels) * k)
