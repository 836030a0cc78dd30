"""What the comparison scripts share: reading the data's .fvecs / .ivecs files, recall@k, and
the filtered scripts' scoring (recall and short answers) and one-query-per-call timing."""

import time

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


def filtered_score(answers, truth, n_matches, k=10):
    """Recall@k of filtered answers against their exact truth, and how many answers are short
    (fewer than min(k, matches) hits)."""
    found = wanted = short = 0
    for answer, t, m in zip(answers, truth, n_matches):
        if len(answer) < min(k, m):
            short += 1
        wanted += len(t)
        found += len(set(int(a) for a in answer) & set(t))
    return (found / wanted if wanted else 1.0), short


def timed(n, search):
    """Answers of `search(q)` for q in 0..n, one call each after 50 untimed ones, and the rate."""
    for q in range(min(n, 50)):
        search(q)
    start = time.perf_counter()
    answers = [search(q) for q in range(n)]
    return answers, n / (time.perf_counter() - start)
