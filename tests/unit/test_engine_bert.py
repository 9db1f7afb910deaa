"""A Hugging Face BertForPreTraining (tiny config, random init, no download) trains end to end."""

import pytest
import torch

from orttrainer import ORTTrainer, ORTTrainerOptions, optim

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 120, 16, 4
BERT_DESC = {
    "inputs": [("input_ids", ["batch", "seq"]), ("attention_mask", ["batch", "seq"]),
               ("token_type_ids", ["batch", "seq"]), ("labels", ["batch", "seq"]),
               ("next_sentence_label", ["batch"])],
    "outputs": [("loss", [], True), ("prediction_logits", ["batch", "seq", VOCAB]),
                ("seq_relationship_logits", ["batch", 2])],
}


def tiny_bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64)
    return transformers.BertForPreTraining(config)


def fixed_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.full((BATCH, SEQ), -100)
    labels[:, 1::4] = ids[:, 1::4]  # mask-LM targets on a quarter of the positions
    return (ids, torch.ones(BATCH, SEQ, dtype=torch.long), torch.zeros(BATCH, SEQ, dtype=torch.long), labels,
            torch.randint(0, 2, (BATCH,), generator=g))


@pytest.mark.parametrize("optim_config", [optim.LambConfig(lr=5e-2), optim.AdamConfig(lr=1e-3)], ids=["lamb", "adam"])
def test_bert_pretraining_loss_falls(optim_config):
    trainer = ORTTrainer(tiny_bert(), BERT_DESC, optim_config, options=ORTTrainerOptions({"device": {"id": "cpu"}}))
    batch = fixed_batch()
    losses = [trainer.train_step(*batch)[0].item() for _ in range(30)]
    assert losses[-1] < 0.7 * losses[0], losses
    prediction, relationship = trainer.eval_step(*batch)[1:]
    assert list(prediction.shape) == [BATCH, SEQ, VOCAB] and list(relationship.shape) == [BATCH, 2]


def test_bert_forward_matches_torch():
    model = tiny_bert()
    trainer = ORTTrainer(model, BERT_DESC, optim.SGDConfig(lr=0.0), options=ORTTrainerOptions({"device": {"id": "cpu"}}))
    batch = fixed_batch()
    loss, prediction, _ = trainer.eval_step(*batch)
    model.eval()
    with torch.no_grad():
        expected = model(*batch[:3], labels=batch[3], next_sentence_label=batch[4])
    torch.testing.assert_close(prediction, expected.prediction_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(loss, expected.loss, rtol=1e-4, atol=1e-4)
