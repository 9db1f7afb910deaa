"""A BERT pretraining script written the 2020 way against the old class (onnxruntime.capi.ort_trainer):
IODescription/ModelDescription, a Hugging Face style optimizer-attribute map, get_lr_this_step with a
warm-up/poly schedule, a LossScaler in fp16 runs, `train_step(*batch)`; an evaluation at the end with an
explicit learning-rate tensor run. Only the import path differs from such a script. The model is a tiny
BERT-like network whose forward() names differ from the descriptions (as in the 2020 scripts, whose
descriptions said segment_ids/input_mask where BertForPreTraining says token_type_ids/attention_mask):
the old class passed the inputs in order. Writes {"losses": [...], ...} as JSON to --out.
"""

import argparse
import json

import torch
import torch.nn.functional as F

from orttrainer.ort_trainer import IODescription, LossScaler, ModelDescription, ORTTrainer


class TinyBertForPreTraining(torch.nn.Module):
    def __init__(self, vocab_size, hidden=16, max_len=16):
        super().__init__()
        self.word_embeddings = torch.nn.Embedding(vocab_size, hidden)
        self.position_embeddings = torch.nn.Embedding(max_len, hidden)
        self.token_type_embeddings = torch.nn.Embedding(2, hidden)
        self.LayerNorm = torch.nn.LayerNorm(hidden)
        self.query = torch.nn.Linear(hidden, hidden)
        self.key = torch.nn.Linear(hidden, hidden)
        self.value = torch.nn.Linear(hidden, hidden)
        self.intermediate = torch.nn.Linear(hidden, 2 * hidden)
        self.output = torch.nn.Linear(2 * hidden, hidden)
        self.pooler = torch.nn.Linear(hidden, hidden)
        self.seq_relationship = torch.nn.Linear(hidden, 2)

    def forward(self, input_ids, token_type_ids, attention_mask, masked_lm_labels, next_sentence_label):
        positions = torch.arange(input_ids.shape[1])
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        x = self.LayerNorm(x + self.token_type_embeddings(token_type_ids))
        scores = self.query(x) @ self.key(x).transpose(1, 2) / 4.0
        scores = scores + (1.0 - attention_mask[:, None, :].float()) * -10000.0
        x = x + scores.softmax(-1) @ self.value(x)
        x = x + self.output(F.gelu(self.intermediate(x)))
        prediction_scores = x @ self.word_embeddings.weight.t()
        seq_relationship_score = self.seq_relationship(torch.tanh(self.pooler(x[:, 0])))
        masked_lm_loss = F.cross_entropy(prediction_scores.reshape(-1, prediction_scores.shape[-1]),
                                         masked_lm_labels.reshape(-1), ignore_index=-1)
        next_sentence_loss = F.cross_entropy(seq_relationship_score, next_sentence_label)
        return masked_lm_loss + next_sentence_loss


def bert_model_description(vocab_size):
    input_ids_desc = IODescription("input_ids", ["batch", "max_seq_len_in_batch"], torch.int64,
                                   num_classes=vocab_size)
    segment_ids_desc = IODescription("segment_ids", ["batch", "max_seq_len_in_batch"], torch.int64, num_classes=2)
    input_mask_desc = IODescription("input_mask", ["batch", "max_seq_len_in_batch"], torch.int64, num_classes=2)
    masked_lm_labels_desc = IODescription("masked_lm_labels", ["batch", "max_seq_len_in_batch"], torch.int64,
                                          num_classes=vocab_size)
    next_sentence_labels_desc = IODescription("next_sentence_labels", ["batch"], torch.int64, num_classes=2)
    loss_desc = IODescription("loss", [], torch.float32)
    return ModelDescription([input_ids_desc, segment_ids_desc, input_mask_desc, masked_lm_labels_desc,
                             next_sentence_labels_desc], [loss_desc])


def warmup_poly(x, warmup=0.002, degree=0.5):
    if x < warmup:
        return x / warmup
    return (1.0 - x) ** degree


def get_lr(args, training_steps):
    return args.learning_rate * warmup_poly(training_steps / args.max_steps, args.warmup_proportion)


def map_optimizer_attributes(name):
    no_decay_keys = ["bias", "gamma", "beta", "LayerNorm"]
    no_decay = any(no_decay_key in name for no_decay_key in no_decay_keys)
    if no_decay:
        return {"alpha": 0.9, "beta": 0.999, "lambda": 0.0, "epsilon": 1e-6}
    return {"alpha": 0.9, "beta": 0.999, "lambda": 0.01, "epsilon": 1e-6}


def make_batches(args):
    g = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(args.max_steps * args.gradient_accumulation_steps + 1):
        input_ids = torch.randint(0, args.vocab_size, (4, 12), generator=g)
        segment_ids = (torch.arange(12) >= 6).long().expand(4, 12).contiguous()
        input_mask = torch.ones(4, 12, dtype=torch.int64)
        input_mask[0, 10:] = 0
        masked_lm_labels = torch.where(torch.rand(4, 12, generator=g) < 0.3, input_ids, torch.full_like(input_ids, -1))
        next_sentence_labels = torch.randint(0, 2, (4,), generator=g)
        batches.append([input_ids, segment_ids, input_mask, masked_lm_labels, next_sentence_labels])
    return batches


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--learning_rate", type=float, default=0.05)
    parser.add_argument("--warmup_proportion", type=float, default=0.2)
    parser.add_argument("--max_steps", type=int, default=6)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--vocab_size", type=int, default=40)
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.manual_seed(42)
    model = TinyBertForPreTraining(args.vocab_size)
    device = torch.device("cpu")
    model_desc = bert_model_description(args.vocab_size)

    def get_lr_this_step(global_step):
        return get_lr(args, global_step)

    loss_scaler = LossScaler("loss_scale_input_name", True, up_scale_window=2000) if args.fp16 else None
    model = ORTTrainer(model, None, model_desc, "LambOptimizer",
                       map_optimizer_attributes=map_optimizer_attributes,
                       learning_rate_description=IODescription("Learning_Rate", [1], torch.float32),
                       device=device,
                       gradient_accumulation_steps=args.gradient_accumulation_steps,
                       world_rank=0, world_size=1,
                       use_mixed_precision=args.fp16,
                       allreduce_post_accumulation=True,
                       get_lr_this_step=get_lr_this_step,
                       loss_scaler=loss_scaler,
                       _opset_version=12)

    batches = make_batches(args)
    losses = []
    model.train()
    for step, batch in enumerate(batches[:-1]):
        loss = model.train_step(*batch)
        losses.append(loss.item())
        if (step + 1) % args.gradient_accumulation_steps == 0:
            print(f"global_step {model.global_step_} loss {loss.item():.4f}")

    model.eval()
    eval_loss = model(*batches[0]).item()
    state = model.state_dict()
    result = {"losses": losses, "eval_loss": eval_loss, "global_step": model.global_step_,
              "loss_scale": loss_scaler.loss_scale_ if loss_scaler else None, "state_keys": sorted(state)}
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
