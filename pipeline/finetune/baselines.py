"""Non-neural baselines of a fine-tuning task, the floor a fine-tuned model must clear.

    scores = baseline_scores(spec, train, dev)   # {"majority": {...}, "bag-of-words": {...}}

- **majority** (classification): every dev example gets the most frequent training label.
- **bag-of-words** (single texts): a linear model on which words a text contains, trained on
  the training split; logistic regression for classes, ridge regression for numbers.
- **word overlap** (text pairs): a linear model of the same kind on how much the two texts
  share (word and bigram Jaccard, the shared words as a part of each text, their length
  ratio); no word identities, so it measures what overlap alone explains.

Both linear models minimise the mean loss plus `0.5 / n * ||w||^2` (scikit-learn's default
`C=1`, scaled to a mean) with full-batch L-BFGS, so they are deterministic and take seconds on
a GLUE training set. Dev scores use the task's own metrics (`pipeline.finetune.metrics`).

A suite keeps each task's scores in `baselines.json` (`pipeline.finetune.results.Baselines`).
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from datamodules.tasks.labels import build_label_map
from datamodules.tasks.spec import Example, TaskSpec
from pipeline.finetune.metrics import task_metrics
from pipeline.finetune.results import Scores

WORD = re.compile(r"\w+", re.UNICODE)
MIN_WORD_COUNT = 2  # a word seen once in training carries no weight a dev text could reuse
LBFGS_ITERATIONS = 200


def words(text: str) -> list[str]:
    """Lower-cased word tokens (runs of letters, digits and underscores)."""
    return WORD.findall(text.lower())


def baseline_scores(
    spec: TaskSpec, train: Sequence[Example], dev: Sequence[Example]
) -> dict[str, Scores]:
    """The dev metrics of every baseline that fits the task, by baseline name.

    Raises:
        ValueError: an empty training or dev split.
    """
    if not train or not dev:
        raise ValueError(
            f"task {spec.name!r}: baselines need training and dev examples "
            f"(got {len(train)} and {len(dev)})"
        )
    label_map = build_label_map(spec, train)
    num_labels = label_map.num_labels
    if spec.is_regression:
        y_train = torch.tensor([float(e.label) for e in train])
        y_dev = torch.tensor([float(e.label) for e in dev])
    else:
        to_id = label_map.label_to_id
        y_train = torch.tensor([to_id[e.label] for e in train])
        y_dev = torch.tensor([to_id[e.label] for e in dev])
    metric_names = list(spec.ordered_metrics)
    out: dict[str, Scores] = {}
    if not spec.is_regression:
        majority = Counter(y_train.tolist()).most_common(1)[0][0]
        out["majority"] = dev_scores(
            metric_names, num_labels, torch.full_like(y_dev, majority), y_dev
        )
    if spec.is_pair:
        name, x_train, x_dev = "word overlap", overlap_features(train), overlap_features(dev)
        x_train, x_dev = standardize(x_train, x_dev)
    else:
        vocabulary = bag_vocabulary(train)
        name = "bag-of-words"
        x_train, x_dev = bag_features(train, vocabulary), bag_features(dev, vocabulary)
    weight, bias = fit_linear(x_train, y_train, num_labels)
    out[name] = dev_scores(metric_names, num_labels, predict_linear(x_dev, weight, bias), y_dev)
    return out


def dev_scores(
    names: list[str], num_labels: int, preds: torch.Tensor, target: torch.Tensor
) -> Scores:
    """The task's metrics (`names`) of predictions against targets."""
    metrics = task_metrics(names, num_labels)
    metrics.update(preds, target)
    return {k: float(v) for k, v in metrics.compute().items()}


# --- features -------------------------------------------------------------------------------


def bag_vocabulary(examples: Sequence[Example]) -> dict[str, int]:
    """Word -> column, for the words of at least `MIN_WORD_COUNT` training texts."""
    counts = Counter(w for e in examples for w in set(words(" ".join(e.texts))))
    kept = sorted(w for w, n in counts.items() if n >= MIN_WORD_COUNT)
    return {w: i for i, w in enumerate(kept)}


def bag_features(examples: Sequence[Example], vocabulary: dict[str, int]) -> torch.Tensor:
    """(N, V) sparse 0/1 matrix: which vocabulary words each example contains."""
    rows, cols = [], []
    for row, example in enumerate(examples):
        present = {vocabulary[w] for w in words(" ".join(example.texts)) if w in vocabulary}
        rows += [row] * len(present)
        cols += sorted(present)
    indices = torch.tensor([rows, cols], dtype=torch.long).reshape(2, -1)
    values = torch.ones(indices.shape[1])
    shape = (len(examples), len(vocabulary))
    return torch.sparse_coo_tensor(indices, values, shape, check_invariants=True).coalesce()


def _bigrams(tokens: list[str]) -> set[tuple[str, str]]:
    return set(itertools.pairwise(tokens))


def _jaccard(a: set, b: set) -> float:
    union = a | b
    return len(a & b) / len(union) if union else 0.0


def overlap_features(examples: Sequence[Example]) -> torch.Tensor:
    """(N, 5): word Jaccard, bigram Jaccard, shared words / words of text 1, shared words /
    words of text 2, |log(length 1 / length 2)|, for pairs of texts."""
    rows = []
    for example in examples:
        first, second = (words(t) for t in example.texts[:2])
        a, b = set(first), set(second)
        shared = len(a & b)
        rows.append(
            [
                _jaccard(a, b),
                _jaccard(_bigrams(first), _bigrams(second)),
                shared / len(a) if a else 0.0,
                shared / len(b) if b else 0.0,
                abs(math.log((len(first) + 1) / (len(second) + 1))),
            ]
        )
    return torch.tensor(rows, dtype=torch.float32).reshape(len(examples), 5)


def standardize(train: torch.Tensor, dev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both feature matrices scaled by the training features' column means and deviations."""
    mean, std = train.mean(0), train.std(0).clamp_min(1e-6)
    return (train - mean) / std, (dev - mean) / std


# --- the linear model -------------------------------------------------------------------------


def fit_linear(
    x: torch.Tensor, y: torch.Tensor, num_labels: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights (F, C) and bias (C,) of a linear model fitted by L-BFGS: logistic regression
    (cross-entropy) for `num_labels` >= 2 classes, ridge regression (squared error, C = 1)
    for `num_labels` = 1; L2 penalty 0.5 / N on the weights.

    Args:
        x: (N, F) features, dense or sparse.
        y: (N,) class ids, or float targets for regression.
    """
    n, features = x.shape
    classes = max(num_labels, 1)
    weight = torch.zeros(features, classes, requires_grad=True)
    bias = torch.zeros(classes, requires_grad=True)
    if num_labels == 1:
        with torch.no_grad():
            bias.fill_(float(y.float().mean()))
    optimizer = torch.optim.LBFGS(
        [weight, bias], max_iter=LBFGS_ITERATIONS, line_search_fn="strong_wolfe"
    )

    def loss() -> torch.Tensor:
        optimizer.zero_grad()
        out = predict_linear(x, weight, bias)
        data = F.mse_loss(out, y.float()) if num_labels == 1 else F.cross_entropy(out, y)
        value = data + 0.5 / n * weight.pow(2).sum()
        value.backward()
        return value

    optimizer.step(loss)
    return weight.detach(), bias.detach()


def predict_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """(N, C) logits, or (N,) numbers for a one-column (regression) model."""
    out = (torch.sparse.mm(x, weight) if x.is_sparse else x @ weight) + bias
    return out.squeeze(1) if out.shape[1] == 1 else out
