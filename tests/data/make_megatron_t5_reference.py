#!/usr/bin/env python
"""Write tests/data/megatron_t5_reference.npz with Megatron-LM's own legacy T5 data code.

    python tests/data/make_megatron_t5_reference.py /path/to/Megatron-LM   # a checkout at 25a99468cd^

Megatron's ``helpers.cpp`` ``build_mapping`` is compiled with g++ against a small stand-in for the
pybind11 arrays it takes (no pybind11 needed) and run on synthetic sentence lengths;
``t5_dataset.build_training_sample`` (with ``dataset_utils.create_masked_lm_predictions``) runs on
WordPiece ids of data_test/bert/vocab.txt with 100 extra ids. Not run by the test suite.
"""
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "data", "megatron_t5_reference.npz")
# Just what build_mapping uses of pybind11: unchecked 1-D reads, shapes, and the array it returns.
PYBIND11_STANDIN = r"""
#include <vector>
#include <cstdint>
#include <cstddef>
#include <functional>
namespace pybind11 {
template <typename T> struct array_t {
  const T *data_; std::vector<long> shape_;
  struct acc { const T *d; long n; long shape(int) const { return n; } const T &operator[](long i) const { return d[i]; } const T &operator()(long i) const { return d[i]; } };
  template <int N> acc unchecked() const { return acc{data_, shape_[0]}; }
  long shape(int i) const { return shape_[i]; }
  long size() const { return shape_[0]; }
};
struct capsule { template <typename F> capsule(void *, F) {} };
struct array { void *ptr; std::vector<int64_t> shape; array(std::vector<int64_t> s, std::vector<long>, void *p, capsule) : ptr(p), shape(s) {} };
}
"""
HEADER = r"""
#include <algorithm>
#include <iostream>
#include <limits>
#include <math.h>
#include <stdexcept>
#include <random>
#include <cstdio>
#include <cassert>
#include "stub.h"
namespace py = pybind11;
using namespace std;
const int32_t LONG_SENTENCE_LEN = 512;
"""
# Reads docs.bin (int64) and sizes.bin (int32), writes the mapping as int64 triples.
DRIVER = r"""
int main(int argc, char **argv) {
  // args: docs.bin sizes.bin num_epochs max_num_samples max_seq_length short_seq_prob seed min_num_sent out.bin
  auto rd = [](const char *path, size_t elem, size_t &n) { FILE *f = fopen(path, "rb"); fseek(f, 0, SEEK_END); long b = ftell(f); fseek(f, 0, SEEK_SET); n = b / elem; char *p = new char[b]; fread(p, 1, b, f); fclose(f); return p; };
  size_t nd, ns;
  int64_t *docs = (int64_t *)rd(argv[1], 8, nd);
  int32_t *sizes = (int32_t *)rd(argv[2], 4, ns);
  py::array_t<int64_t> d{docs, {(long)nd}};
  py::array_t<int> s{sizes, {(long)ns}};
  py::array out = build_mapping(d, s, atoi(argv[3]), strtoull(argv[4], 0, 10), atoi(argv[5]), atof(argv[6]), atoi(argv[7]), false, atoi(argv[8]));
  FILE *f = fopen(argv[9], "wb");
  // Always written as int64 triples.
  bool wide = ns > std::numeric_limits<uint32_t>::max();
  for (int64_t i = 0; i < 3 * out.shape[0]; ++i) { int64_t v = wide ? ((uint64_t *)out.ptr)[i] : ((uint32_t *)out.ptr)[i]; fwrite(&v, 8, 1, f); }
  fclose(f);
  return 0;
}
"""


def compile_build_mapping(megatron: str, work: str) -> str:
    """Megatron's build_mapping (helpers.cpp) as a command-line program in ``work``."""
    with open(os.path.join(megatron, "megatron/core/datasets/helpers.cpp")) as f:
        helpers = f.read()
    start = helpers.index("inline int32_t get_target_sample_len")
    end = helpers.index("template <typename DocIdx>\npy::array build_blocks_mapping_impl")
    with open(os.path.join(work, "stub.h"), "w") as f:
        f.write(PYBIND11_STANDIN)
    with open(os.path.join(work, "mapping.cpp"), "w") as f:
        f.write(HEADER + helpers[start:end] + DRIVER)
    binary = os.path.join(work, "mapping")
    subprocess.run(["g++", "-O2", "-std=c++17", "-o", binary, os.path.join(work, "mapping.cpp")], check=True)
    return binary


def megatron_sample_builder(megatron: str):
    """Megatron's build_training_sample with the functions it calls, from its sources."""
    def grab(path, start, end):
        with open(os.path.join(megatron, path)) as f:
            src = f.read()
        a = src.index(start)
        return src[a:src.index(end, a + 1)]

    code = "import collections\nimport numpy as np\nimport torch\n"
    code += grab("megatron/data/dataset_utils.py", "MaskedLmInstance = collections.namedtuple",
                 "\ndef pad_and_convert_to_numpy")
    code += grab("megatron/data/t5_dataset.py", "def build_training_sample", "\ndef make_attention_mask_3d")
    code += grab("megatron/data/t5_dataset.py", "def make_history_mask(block)", "\ndef make_history_mask_3d")
    namespace = {}
    exec(code, namespace)
    return namespace["build_training_sample"]


def main(megatron: str) -> None:
    from libai_lite.tokenizer import build_tokenizer

    work = tempfile.mkdtemp()
    binary = compile_build_mapping(megatron, work)
    build_training_sample = megatron_sample_builder(megatron)
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=os.path.join(ROOT, "data_test/bert/vocab.txt"),
                          vocab_extra_ids=100)
    inv = {i: tok.id_to_token(i) for i in range(tok.vocab_size)}
    rng = np.random.default_rng(7)
    ordinary = [i for i in range(5, 8000) if inv[i] is not None]
    continuations = [i for i in ordinary if inv[i].startswith("##")]
    arrays = {}
    # Samples of 1-5 sentences, a quarter of the pieces "##" continuations, some sentences led by [SEP].
    for k in range(40):
        sentences = []
        for _ in range(int(rng.integers(1, 6))):
            n = int(rng.integers(1, 60))
            s = rng.choice(ordinary, n).tolist()
            for p in rng.integers(0, n, n // 4):
                s[p] = int(rng.choice(continuations))
            if rng.random() < 0.2:
                s[0] = tok.sep_token_id
            sentences.append([int(x) for x in s])
        target, idx = int(rng.integers(2, 200)), int(rng.integers(0, 10**6))
        out = build_training_sample(
            sentences, target, 256, 96, list(inv), inv, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id,
            tok.pad_token_id, 0.15, np.random.RandomState(seed=1234 + idx), tok.bos_token_id, tok.eos_token_id,
            tok.additional_special_tokens_ids)
        arrays[f"s{k}_lens"] = np.array([len(s) for s in sentences])
        arrays[f"s{k}_tokens"] = np.array(sum(sentences, []))
        arrays[f"s{k}_meta"] = np.array([target, idx])
        for key in ("text_enc", "text_dec", "labels", "loss_mask"):
            arrays[f"s{k}_{key}"] = out[key]
        arrays[f"s{k}_truncated"] = np.array(out["truncated"])
    # 400 documents over 3,000 sentences, an empty document, six sentences over 512 tokens.
    sizes = rng.integers(1, 80, 3000).astype(np.int32)
    sizes[rng.integers(0, 3000, 6)] = 600
    bounds = np.sort(rng.choice(np.arange(1, 3000), 399, replace=False))
    doc_idx = np.concatenate([[0], bounds, [3000]]).astype(np.int64)
    doc_idx[50] = doc_idx[49]
    doc_idx = np.maximum.accumulate(doc_idx)
    split = doc_idx[100:301]
    # (documents, epochs, max samples, max sequence length, short_seq_prob, seed); None: no limit.
    cases = [(split, None, 500, 126, 0.1, 1234), (split, None, 1500, 126, 0.1, 1234),
             (doc_idx, None, 1000, 510, 0.0, 7), (doc_idx, 1, None, 62, 0.3, 99), (split, None, 20, 30, 1.0, 5)]
    for c, (docs, epochs, samples, length, short, seed) in enumerate(cases):
        docs.astype(np.int64).tofile(os.path.join(work, "docs.bin"))
        sizes.tofile(os.path.join(work, "sizes.bin"))
        out = os.path.join(work, "out.bin")
        subprocess.run([binary, os.path.join(work, "docs.bin"), os.path.join(work, "sizes.bin"),
                        str(epochs or np.iinfo(np.int32).max - 1), str(samples or np.iinfo(np.int64).max - 1),
                        str(length), str(short), str(seed), "1", out], check=True)
        arrays[f"m{c}_doc_idx"] = docs
        arrays[f"m{c}_params"] = np.array([epochs or 0, samples or 0, length, seed], dtype=np.int64)
        arrays[f"m{c}_ssp"] = np.array(short)
        arrays[f"m{c}_expected"] = np.fromfile(out, dtype=np.int64).reshape(-1, 3)
    arrays["sizes"] = sizes
    # int32 where the values fit (all but the parameters), to keep the file small.
    arrays = {k: v.astype(np.int32) if v.dtype == np.int64 and not k.endswith("_params") else v
              for k, v in arrays.items()}
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main(sys.argv[1])
