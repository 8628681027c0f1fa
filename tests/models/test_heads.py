"""Sequence classification / regression heads over BERT and GPT."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.bert import BertConfig, BertForPreTraining
from models.gpt import GPT, GPTConfig
from models.heads import (
    SequenceClassifier,
    last_token_index,
    pair_alignment,
    pair_side_widths,
    sequence_loss,
)

V = 500


def test_last_token_index_for_both_padding_sides():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert last_token_index(mask).tolist() == [2, 4, 4]


def test_bert_head_scores_the_pooled_cls_state():
    torch.manual_seed(0)
    bert = BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=V))
    head = SequenceClassifier(bert, 3).eval()
    assert head.backbone is bert.bert
    ids = torch.randint(0, V, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with torch.no_grad():
        pooled = bert.bert(ids, attention_mask=mask).pooled
        logits = head(ids, attention_mask=mask)
    torch.testing.assert_close(logits, head.classifier(pooled))
    assert logits.shape == (2, 3)


def test_gpt_head_uses_last_real_token_whatever_the_padding_side():
    torch.manual_seed(0)
    head = SequenceClassifier(GPT(GPTConfig.from_preset("tiny", vocab_size=V)), 2).eval()
    seq = torch.randint(0, V, (1, 6))
    pad = torch.zeros(1, 3, dtype=torch.long)
    ones, zeros = torch.ones(1, 6, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long)
    with torch.no_grad():
        alone = head(seq)
        right = head(torch.cat([seq, pad], 1), attention_mask=torch.cat([ones, zeros], 1))
        left = head(torch.cat([pad, seq], 1), attention_mask=torch.cat([zeros, ones], 1))
    torch.testing.assert_close(right, alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(left, alone, atol=1e-5, rtol=0)


def test_regression_head_and_losses():
    torch.manual_seed(0)
    head = SequenceClassifier(BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=V)), 1)
    ids = torch.randint(0, V, (4, 7))
    scores = head(ids)
    assert scores.shape == (4, 1)
    labels = torch.tensor([0.0, 1.5, 3.0, 5.0])
    torch.testing.assert_close(sequence_loss(scores, labels), F.mse_loss(scores[:, 0], labels))
    logits = torch.randn(4, 3)
    classes = torch.tensor([0, 2, 1, 2])
    torch.testing.assert_close(sequence_loss(logits, classes), F.cross_entropy(logits, classes))
    sequence_loss(scores, labels).backward()
    assert head.classifier.weight.grad is not None


def test_head_rejects_bad_arguments():
    with pytest.raises(TypeError, match="Linear"):
        SequenceClassifier(torch.nn.Linear(2, 2), 2)
    with pytest.raises(ValueError, match="n_outputs"):
        SequenceClassifier(GPT(GPTConfig.from_preset("tiny", vocab_size=V)), 0)


@pytest.mark.parametrize("family", ["bert", "gpt"])
def test_mean_pooling_averages_the_real_tokens_states(family):
    torch.manual_seed(0)
    model = (
        BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=V))
        if family == "bert"
        else GPT(GPTConfig.from_preset("tiny", vocab_size=V))
    )
    head = SequenceClassifier(model, 2, pooling="mean").eval()
    ids = torch.randint(0, V, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, 4:] = 0
    with torch.no_grad():
        got = head.features(ids, attention_mask=mask)
        short = head.features(ids[:1, :4], attention_mask=mask[:1, :4])  # no padding at all
        states = (
            model.bert(ids, attention_mask=mask).hidden_states
            if family == "bert"
            else model.model(ids, attention_mask=mask)
        )
    torch.testing.assert_close(got[1], states[1].mean(0))
    torch.testing.assert_close(got[0], short[0], atol=1e-5, rtol=0)  # padding is left out


@pytest.mark.parametrize("pooling", [None, "mean"])
def test_a_siamese_head_scores_each_pair_from_its_two_texts_read_alone(pooling):
    """Rows 2i and 2i+1 are the two texts of pair i: the scores are the linear layer on
    [u, v, |u - v|, u * v] of the features each text gets alone (padding changes nothing)."""
    torch.manual_seed(0)
    bert = BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=V))
    head = SequenceClassifier(bert, 3, pooling=pooling, siamese=True).eval()
    assert head.classifier.in_features == 4 * bert.config.d_model
    texts = [torch.randint(0, V, (1, n)) for n in (5, 8, 3, 8)]  # pairs (0, 1) and (2, 3)
    ids = torch.zeros(4, 8, dtype=torch.long)
    mask = torch.zeros(4, 8, dtype=torch.long)
    for row, text in enumerate(texts):
        ids[row, : text.shape[1]], mask[row, : text.shape[1]] = text, 1
    with torch.no_grad():
        scores = head(ids, attention_mask=mask)
        alone = [head.features(t, attention_mask=torch.ones_like(t))[0] for t in texts]
        for pair, (u, v) in enumerate([(alone[0], alone[1]), (alone[2], alone[3])]):
            expected = head.classifier(torch.cat([u, v, (u - v).abs(), u * v]))
            torch.testing.assert_close(scores[pair], expected, atol=1e-5, rtol=0)
    assert scores.shape == (2, 3)
    with pytest.raises(ValueError, match="pairs of rows"):
        head(ids[:3], attention_mask=mask[:3])


def pairs_batch(lengths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Right-padded rows of the given lengths (pairs: rows 2i, 2i + 1) and each text alone."""
    texts = [torch.randint(0, V, (1, n)) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(texts), width, dtype=torch.long)
    mask = torch.zeros(len(texts), width, dtype=torch.long)
    for row, text in enumerate(texts):
        ids[row, : text.shape[1]], mask[row, : text.shape[1]] = text, 1
    return ids, mask, texts


def test_a_cosine_pair_score_is_the_standardized_cosine_of_the_two_texts_read_alone():
    """Regression read apart, pair_score="cosine": mean + std * norm(cos(u, v)) with u and v
    each text's own features; training standardizes by the batch, so a fresh head's
    predictions have the targets' mean and spread whatever the cosines' level; evaluation
    uses the running statistics, which the first training batch sets."""
    torch.manual_seed(0)
    bert = BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=V))
    mean, std = 2.5, 1.5
    head = SequenceClassifier(
        bert, 1, pooling="mean", siamese=True, pair_score="cosine", target=(mean, std), dropout=0
    )
    ids, mask, texts = pairs_batch((5, 8, 3, 8, 6, 2, 7, 7))
    head.train().backbone.eval()  # the norm in training mode, the encoder without dropout
    with torch.no_grad():
        trained = head(ids, attention_mask=mask).squeeze(-1)
        alone = [head.features(t, attention_mask=torch.ones_like(t))[0] for t in texts]
    cos = torch.stack([F.cosine_similarity(alone[i], alone[i + 1], dim=0) for i in (0, 2, 4, 6)])
    standardized = (cos - cos.mean()) / (cos.var(correction=0) + 1e-5).sqrt()
    torch.testing.assert_close(trained, mean + std * standardized, atol=1e-4, rtol=0)
    assert trained.mean().item() == pytest.approx(mean, abs=1e-4)
    norm = head.classifier
    # the first training batch sets the running statistics (not mean 0, variance 1)
    torch.testing.assert_close(norm.running_mean, cos.mean().reshape(1))
    torch.testing.assert_close(norm.running_var, cos.var().reshape(1))
    with torch.no_grad():
        evaluated = head.eval()(ids, attention_mask=mask).squeeze(-1)
    running = (cos - norm.running_mean) / (norm.running_var + norm.eps).sqrt()
    torch.testing.assert_close(evaluated, mean + std * running, atol=1e-4, rtol=0)
    head.train().backbone.eval()
    one_pair = head(ids[:2], attention_mask=mask[:2])  # no spread: the running statistics
    torch.testing.assert_close(one_pair.detach().squeeze(), evaluated[0], atol=1e-4, rtol=0)


def test_the_cosine_pair_score_is_for_regression_pairs_only():
    bert = BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=V))
    with pytest.raises(ValueError, match="regression head, not 3 classes"):
        SequenceClassifier(bert, 3, siamese=True, pair_score="cosine")
    with pytest.raises(ValueError, match="pair_score"):
        SequenceClassifier(bert, 1, siamese=True, pair_score="dot")
    cosine = SequenceClassifier(bert, 1, siamese=True, pair_score="cosine")
    with pytest.raises(ValueError, match="scores pairs of texts"):
        cosine.classify(torch.zeros(2, bert.config.d_model))  # e.g. a document's chunks
    # a single-text head ignores it: its linear layer reads the features
    assert isinstance(SequenceClassifier(bert, 1, pair_score="cosine").classifier, torch.nn.Linear)


def test_unknown_pooling_is_refused():
    bert = BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=V))
    with pytest.raises(ValueError, match="pooling"):
        SequenceClassifier(bert, 2, pooling="max")


def brute_alignment(x_TD: torch.Tensor, y_TD: torch.Tensor) -> list[float]:
    """Mean over x's tokens of the best cosine with y's, then y's with x's, by loops."""

    def one_way(a, b):
        best = [max(F.cosine_similarity(t, s, dim=0).item() for s in b) for t in a]
        return sum(best) / len(best)

    return [one_way(x_TD, y_TD), one_way(y_TD, x_TD)]


@pytest.mark.parametrize("family", ["bert", "gpt"])
def test_alignment_scores_are_best_match_cosines_both_ways_without_special_tokens(family):
    """pair_score="alignment": per pair, at the word embeddings and at the last layer, each
    text's mean best-match cosine with the other's tokens, both ways; special tokens and
    padding take no part (as a token or as a match)."""
    torch.manual_seed(0)
    if family == "bert":
        model = BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=V))
    else:
        model = GPT(GPTConfig.from_preset("tiny", vocab_size=V))
    special = (1, 2)
    head = SequenceClassifier(
        model, 2, pooling="mean", siamese=True, pair_score="alignment", special_ids=special
    ).eval()
    # pair 0: [1] 10 11 12 [2] | [1] 12 13 [2] pad; pair 1: the same text twice
    ids = torch.tensor(
        [[1, 10, 11, 12, 2], [1, 12, 13, 2, 0], [1, 20, 21, 22, 2], [1, 20, 21, 22, 2]]
    )
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1] * 5, [1] * 5])
    with torch.no_grad():
        scores = head.alignment_scores(ids, attention_mask=mask)
        words = (
            head.backbone.tok_emb(ids) if family == "gpt" else head.backbone.embeddings.word(ids)
        )
        if family == "bert":
            states = head.backbone(ids, attention_mask=mask).hidden_states
        else:
            states = head.backbone(ids, attention_mask=mask)
    assert scores.shape == (2, 4)
    content = [slice(1, 4), slice(1, 3)]  # pair 0's words, without [CLS], [SEP] and padding
    for layer, vectors in enumerate((words, states)):
        expected = brute_alignment(vectors[0, content[0]], vectors[1, content[1]])
        torch.testing.assert_close(
            scores[0, 2 * layer : 2 * layer + 2].tolist(), expected, atol=1e-5, rtol=0
        )
    torch.testing.assert_close(scores[1], torch.ones(4), atol=1e-5, rtol=0)  # identical texts
    only_special = torch.tensor([[1, 10, 2], [1, 2, 0]])
    with torch.no_grad():
        empty = head.alignment_scores(
            only_special, attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]])
        )
    assert empty.tolist() == [[0.0, 0.0, 0.0, 0.0]]  # nothing to match: 0, not a -2 sentinel


def test_an_alignment_head_scores_its_standardized_scores_with_the_fitted_layer():
    torch.manual_seed(0)
    bert = BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=V))
    head = SequenceClassifier(
        bert, 1, pooling="mean", siamese=True, pair_score="alignment", target=(2.0, 3.0)
    ).eval()
    ids, mask, _ = pairs_batch((5, 8, 3, 8))
    mean, std = torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0.5, 1.0, 2.0, 4.0])
    weight, bias = torch.tensor([[1.0], [-1.0], [0.5], [2.0]]), torch.tensor([0.25])
    head.fit_alignment(mean, std, weight, bias)
    with torch.no_grad():
        raw = head.alignment_scores(ids, attention_mask=mask)
        predicted = head(ids, attention_mask=mask)
    expected = 2.0 + 3.0 * (((raw - mean) / std) @ weight + bias)  # in the targets' units
    torch.testing.assert_close(predicted, expected, atol=1e-5, rtol=0)
    assert set(head.state_dict()) >= {"score_mean", "score_std"}  # a saved model keeps them
    with pytest.raises(ValueError, match="alignment"):
        SequenceClassifier(bert, 1, siamese=True).fit_alignment(mean, std, weight, bias)


def test_alignment_scores_are_computed_in_fp32_under_bf16_autocast():
    """Cosines of trained states lie a few thousandths apart; under autocast the similarity
    matrix would be rounded to bf16 (steps of about 0.004 near 1), so it is kept in fp32."""
    torch.manual_seed(0)
    vectors = torch.randn(4, 6, 16) + 5.0  # close in angle: cosines near 1
    content = torch.ones(4, 6, dtype=torch.bool)
    with torch.no_grad():
        exact = pair_alignment(vectors, content)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = pair_alignment(vectors, content)
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, exact, atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", ["bert", "gpt"])
@pytest.mark.parametrize("score", ["features-cls", "features-mean", "cosine", "alignment"])
def test_a_pair_batch_reads_each_side_at_its_own_width_with_the_same_scores(family, score):
    """Long first texts and short second texts: the backbone reads the first texts at their
    longest length and the second texts at theirs, not all 2B rows at the batch's width, and
    scores and gradients are those of one batch of all the rows (as before the split)."""
    torch.manual_seed(0)
    if family == "bert":  # no dropout: training's graph, the same numbers in both runs
        model = BertForPreTraining(
            BertConfig.from_preset("tiny", vocab_size=V, dropout=0.0, attn_dropout=0.0)
        )
    else:
        model = GPT(GPTConfig.from_preset("tiny", vocab_size=V))
    pooling, pair_score = {
        "features-cls": (None, "features"),
        "features-mean": ("mean", "features"),
        "cosine": ("mean", "cosine"),
        "alignment": ("mean", "alignment"),
    }[score]
    head = SequenceClassifier(
        model,
        1 if pair_score == "cosine" else 3,
        pooling=pooling,
        siamese=True,
        pair_score=pair_score,
        dropout=0.0,
        special_ids=(1, 2),
    )
    ids, mask, _ = pairs_batch((12, 3, 9, 4, 11, 2))  # premises 12, 9, 11; hypotheses 3, 4, 2
    shapes: list[tuple[int, ...]] = []
    hook = head.backbone.register_forward_pre_hook(
        lambda _module, args: shapes.append(tuple(args[0].shape))
    )
    got = head(ids, attention_mask=mask)
    hook.remove()
    assert shapes == [(3, 12), (3, 4)]
    got.sum().backward()
    split_grads = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
    head.zero_grad(set_to_none=True)

    with pytest.MonkeyPatch.context() as patch:  # before: all rows at the batch's width
        patch.setattr("models.heads.encode_pair_sides", lambda encode, *rows: encode(*rows))
        if pair_score == "cosine":
            head.classifier.reset_running_stats()
        expected = head(ids, attention_mask=mask)
    expected.sum().backward()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for name, param in head.named_parameters():
        if name in split_grads:
            torch.testing.assert_close(split_grads[name], param.grad, atol=1e-5, rtol=1e-4)


def test_pair_side_widths_reach_each_sides_last_real_token():
    right = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    assert pair_side_widths(right) == (4, 2)
    empty_side = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert pair_side_widths(empty_side) == (2, 1)  # a side with no token still gets a column
    left = torch.tensor([[0, 0, 1], [0, 1, 1]])
    assert pair_side_widths(left) == (3, 3)  # left padding: every row ends at the last column
    with pytest.raises(ValueError, match="pairs of rows"):
        pair_side_widths(right[:3])
