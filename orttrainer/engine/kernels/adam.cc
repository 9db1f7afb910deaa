// com.orttrainer::Adam -- onnxruntime's AdamOptimizer update that honours its apply flag and may
// write over its inputs.
//
//   inputs   lr float[1], count int64[1], W, G, M1, M2 (fp32, equal sizes), apply bool[1] (optional)
//   outputs  count', M1', M2', W' (AdamOptimizer's order): the updated values where apply is true
//            (or absent), else count, M1, M2, W unchanged; count' = count + 1 where it updated
//   attrs    alpha, beta, epsilon, lambda, do_bias_correction, weight_decay_mode (AdamOptimizer's)
//
// onnxruntime's CPU AdamOptimizer ignores its update_signal input, so a step that may be discarded
// after it ran (mixed precision's non-finite steps) had to write second copies of every weight and
// moment. This kernel reads `apply` first; an output bound to its input's buffer (the trainer binds
// them so) is then updated in place, or left alone when the step is skipped. Each element is read
// before it is written, so an output may alias its input. The arithmetic is AdamOptimizer's,
// operation for operation in fp32 (bias corrections in double, as there); the square root is the
// exact one (onnxruntime's Eigen approximates it), and the tensor is cut into chunks run on the
// session's intra-op threads (onnxruntime's kernel runs on one).

#include "ort_api.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

using namespace ort;

constexpr int64_t kChunk = 1 << 15;  // elements per task: small tensors run as one

float bias_correction(float coefficient, int64_t step) {
  return step > 0 ? static_cast<float>(1.0 - std::pow(static_cast<double>(coefficient), static_cast<double>(step)))
                  : 1.0f;
}

struct Update {
  const float *w, *g, *m1, *m2;
  float *new_w, *new_m1, *new_m2;  // may be w, m1, m2 themselves
  int64_t n;
  float eta, alpha, beta, epsilon, lambda, alpha_correction, beta_correction;
  int64_t mode;
};

void update_chunk(void* data, size_t index) {
  const Update& u = *static_cast<const Update*>(data);
  const int64_t start = static_cast<int64_t>(index) * kChunk, stop = std::min(u.n, start + kChunk);
  const float one_minus_alpha = 1 - u.alpha, one_minus_beta = 1 - u.beta;
  if (u.mode == 0) {
    // PyTorch's AdamW rule: moments bias-corrected one by one, decay added to the update.
    for (int64_t i = start; i < stop; ++i) {
      const float w = u.w[i], g = u.g[i];
      const float m1 = u.alpha * u.m1[i] + (one_minus_alpha * g);
      const float m2 = u.beta * u.m2[i] + ((one_minus_beta * g) * g);
      const float denom = std::sqrt(m2 / u.beta_correction) + u.epsilon;
      const float update = ((m1 / u.alpha_correction) / denom) + (u.lambda * w);
      u.new_w[i] = w + (-u.eta * update);
      u.new_m1[i] = m1;
      u.new_m2[i] = m2;
    }
  } else {
    // Hugging Face's: bias correction in the step size, decay applied after the update.
    const float step_size = u.eta * std::sqrt(u.beta_correction) / u.alpha_correction;
    const float decay = u.eta * u.lambda;
    for (int64_t i = start; i < stop; ++i) {
      const float w = u.w[i], g = u.g[i];
      const float m1 = u.alpha * u.m1[i] + (one_minus_alpha * g);
      const float m2 = u.beta * u.m2[i] + ((one_minus_beta * g) * g);
      const float denom = std::sqrt(m2) + u.epsilon;
      u.new_w[i] = w + ((-step_size * m1) / denom - decay * (w - (step_size * m1) / denom));
      u.new_m1[i] = m1;
      u.new_m2[i] = m2;
    }
  }
}

void copy_unless_same(float* to, const float* from, int64_t n) {
  if (to != from) std::memcpy(to, from, static_cast<size_t>(n) * sizeof(float));
}

struct AdamKernel {
  float alpha, beta, epsilon, lambda;
  int64_t corrects, mode;  // do_bias_correction, weight_decay_mode

  explicit AdamKernel(const OrtKernelInfo* info)
      : alpha(attribute_or<float>(info, "alpha", 0.9f)),
        beta(attribute_or<float>(info, "beta", 0.999f)),
        epsilon(attribute_or<float>(info, "epsilon", 1e-8f)),
        lambda(attribute_or<float>(info, "lambda", 0.0f)),
        corrects(attribute_or<int64_t>(info, "do_bias_correction", 1)),
        mode(attribute_or<int64_t>(info, "weight_decay_mode", 0)) {
    if (mode != 0 && mode != 1) throw Failure("weight_decay_mode must be 0 or 1");
  }

  void compute(OrtKernelContext* context) const {
    const OrtValue* values[7];
    for (size_t i = 0; i < 7; ++i) values[i] = input(context, i);
    for (size_t i = 0; i < 6; ++i)
      if (values[i] == nullptr) throw Failure("inputs lr, count, W, G, M1 and M2 are required");
    Update u;
    const std::vector<int64_t> shape = dims_of(values[2]);
    u.n = elements_of(values[2]);
    for (size_t i = 3; i < 6; ++i)
      if (elements_of(values[i]) != u.n) throw Failure("W, G, M1 and M2 must have as many elements");
    const int64_t step = *data_of<int64_t>(values[1]);
    const bool apply = values[6] == nullptr || *data_of<bool>(values[6]);
    *data_of<int64_t>(output(context, 0, {1})) = apply ? step + 1 : step;
    u.w = data_of<float>(values[2]);
    u.g = data_of<float>(values[3]);
    u.m1 = data_of<float>(values[4]);
    u.m2 = data_of<float>(values[5]);
    u.new_m1 = data_of<float>(output(context, 1, dims_of(values[4])));
    u.new_m2 = data_of<float>(output(context, 2, dims_of(values[5])));
    u.new_w = data_of<float>(output(context, 3, shape));
    if (!apply) {  // skipped: the outputs hold the inputs (nothing to do where they are the inputs)
      copy_unless_same(u.new_m1, u.m1, u.n);
      copy_unless_same(u.new_m2, u.m2, u.n);
      copy_unless_same(u.new_w, u.w, u.n);
      return;
    }
    u.eta = *data_of<float>(values[0]);
    u.alpha = alpha;
    u.beta = beta;
    u.epsilon = epsilon;
    u.lambda = lambda;
    u.alpha_correction = corrects ? bias_correction(alpha, step) : 1.0f;
    u.beta_correction = corrects ? bias_correction(beta, step) : 1.0f;
    u.mode = mode;
    const size_t tasks = static_cast<size_t>((u.n + kChunk - 1) / kChunk);
    if (tasks == 1) {
      update_chunk(&u, 0);
    } else if (tasks > 1) {
      parallel_for(context, update_chunk, tasks, &u);
    }
  }
};

struct Adam {
  static constexpr const char* name = "Adam";
  static constexpr int inputs[] = {ELEMENT_FLOAT, ELEMENT_INT64, ELEMENT_FLOAT, ELEMENT_FLOAT,
                                   ELEMENT_FLOAT, ELEMENT_FLOAT, ELEMENT_BOOL};
  static constexpr int outputs[] = {ELEMENT_INT64, ELEMENT_FLOAT, ELEMENT_FLOAT, ELEMENT_FLOAT};
  static bool optional(size_t input) { return input == 6; }
  using Kernel = AdamKernel;
};

}  // namespace

const OrtCustomOp* adam_op() {
  static const OrtCustomOp op = ort::describe<Adam>();
  return &op;
}
