"""``lm_loss``: the loss of a model that returns logits, and the hooks features use."""

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom
from torch import nn

from fsdp_turbo.core.lm_loss import add_loss_reducer, lm_loss, pending_loss_request, set_logits_loss


class LogitsModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)
        self.seen = []

    def forward(self, tokens):
        self.seen.append(pending_loss_request(self))
        return self.head(self.embed(tokens))


def _batch():
    tokens = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(1))
    labels = F.pad(tokens[:, 1:], (0, 1), value=-100)
    labels[0, 2] = -100
    return tokens, labels


def test_plain_model_gets_the_mean_over_valid_labels_and_gradients_equal():
    tokens, labels = _batch()
    model = LogitsModel()
    loss = lm_loss(model, labels, tokens)
    loss.backward()
    expected_model = LogitsModel()
    expected = F.cross_entropy(expected_model(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(model.head.weight.grad, expected_model.head.weight.grad, rtol=1e-6, atol=1e-8)
    # the request is visible inside the forward only, and counts the whole batch's labels
    assert model.seen[0] is not None and int(model.seen[0].num_items) == int((labels != -100).sum())
    model(tokens)
    assert model.seen[-1] is None


def test_a_head_that_computes_the_loss_a_logits_loss_and_reducers():
    tokens, labels = _batch()
    model = LogitsModel()
    calls = []

    def logits_loss(logits, labels, *, ignore_index, reduction):
        calls.append((reduction, ignore_index))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=ignore_index, reduction=reduction)

    set_logits_loss(model, logits_loss)
    add_loss_reducer(model, lambda loss: loss * 2)
    add_loss_reducer(model, lambda loss: loss + 1)
    plain = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100)
    torch.testing.assert_close(lm_loss(model, labels, tokens), plain * 2 + 1)
    assert calls == [("sum", -100)]

    class Chunked(LogitsModel):  # answers the request itself, as chunked loss does
        def forward(self, tokens):
            pending_loss_request(self).loss = torch.tensor(7.0)
            return torch.empty(*tokens.shape, 0)

    assert float(lm_loss(Chunked(), labels, tokens)) == 7.0
