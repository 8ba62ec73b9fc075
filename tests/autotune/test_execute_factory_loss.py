"""What execute and tune call a ``--module`` factory's model with (``forward_loss``): a Hugging Face causal LM
(a factory may return transformers' GPT2LMHeadModel) with ``input_ids`` and the targets as ``labels``: its own loss,
the step the README's script and ``calibrate module`` take (it crashed once: the targets went in as its cache);
nanoGPT's ``(logits, loss)`` its loss; a module returning
neither is one line naming the contract."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from calibrate.errors import UserError  # noqa: E402


def test_factory_models_give_their_loss():
    from autotune.execute.moduletrain import forward_loss
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2,
                                                              n_positions=8)).eval()  # no dropout
    ids, targets = torch.randint(32, (2, 8)), torch.randint(32, (2, 8))
    # the labels shifted inside: logit i predicts target i + 1
    want = torch.nn.functional.cross_entropy(hf(input_ids=ids).logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten())
    assert torch.allclose(forward_loss(hf, ids, targets), want)

    class Nano(torch.nn.Module):  # nanoGPT's forward(idx, targets) -> (logits, loss)
        def forward(self, idx, targets):
            return torch.zeros(2, 3), torch.tensor(1.25)
    assert forward_loss(Nano(), ids, targets).item() == 1.25

    class Logits(torch.nn.Module):
        def forward(self, idx, targets):
            return torch.zeros(2, 8, 32)
    with pytest.raises(UserError, match="not the mean loss: return the loss"):
        forward_loss(Logits(), ids, targets)
