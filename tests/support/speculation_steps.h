// The speculative-decoding tests' step builder (CPU and CUDA): sequences whose drafts are forced
// from a plain run (chosen output indices perturbed), decoded together one batch per step.
// `Spec` needs: prompt, params, k, perturbed, plain->out, drafts_forced, seq, out, drafts.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "model/runner.h"

namespace dsv4::test {

// Opens each sequence on `r` and forces its drafts: the plain continuation, with the perturbed
// output indices made wrong.
template <class Spec, class R>
void open_forced(R& r, std::vector<Spec>& seqs, int vocab) {
  for (Spec& s : seqs) {
    s.seq = r.open_sequence();
    s.drafts_forced = s.plain->out;
    for (int t : s.perturbed) s.drafts_forced[size_t(t)] = (s.plain->out[size_t(t)] + 1) % vocab;
  }
}

// One step's inputs: `ins[i]` belongs to `*who[i]` and samples through `specs` (kept alive with
// it). Empty `ins`: every sequence reached its plain run's length.
template <class Spec>
struct SpecStep {
  std::vector<StepInput> ins;
  std::vector<SampleSpec> specs;
  std::vector<Spec*> who;
};

template <class Spec>
SpecStep<Spec> next_step(std::vector<Spec>& seqs, bool first) {
  SpecStep<Spec> st;
  st.specs.resize(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    Spec& s = seqs[i];
    const int n = int(s.plain->out.size());
    if (int(s.out.size()) >= n) continue;
    SampleSpec& sp = st.specs[i];
    sp.params = &s.params;
    sp.index = int64_t(s.out.size());
    sp.draft_override = &s.drafts_forced;
    StepInput in;
    in.seq = s.seq;
    in.tokens = first ? s.prompt : std::vector<int32_t>{s.out.back()};
    // Never emit past the plain run: at most n - out tokens this step.
    const int d = std::min<int>(int(s.drafts.size()), n - int(s.out.size()) - 1);
    in.tokens.insert(in.tokens.end(), s.drafts.begin(), s.drafts.begin() + d);
    in.verify = d;
    in.draft = s.k;
    in.all_logits = true;
    in.sample = &sp;
    st.ins.push_back(std::move(in));
    st.who.push_back(&s);
  }
  return st;
}

}  // namespace dsv4::test
