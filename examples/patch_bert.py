"""Patch a Hugging Face BERT (random weights, built from a config), train a few steps, and print
what autograd saves before and after. Runs on CPU in about a minute: python examples/patch_bert.py"""

import torch
from transformers import BertConfig, BertForSequenceClassification

import invact


def main() -> None:
    torch.manual_seed(0)
    config = BertConfig(num_hidden_layers=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        attn_implementation="sdpa")  # fmt: skip
    model = BertForSequenceClassification(config)
    batch = {"input_ids": torch.randint(0, config.vocab_size, (4, 256)), "labels": torch.randint(0, 2, (4,))}

    before = invact.memory.saved_tensors(model, loss=lambda out: out.loss, **batch)
    replaced = invact.patch(model)  # in place; returns the replaced module names
    after = invact.memory.saved_tensors(model, loss=lambda out: out.loss, **batch)
    print(f"replaced {len(replaced)} activations, e.g. {replaced[0]}")
    print(f"torch:  {before}")
    print(f"InvAct: {after}  ({100 * after.saving_vs(before):+.1f}%)")

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(5):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
