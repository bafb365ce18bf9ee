// The checkpoint reader (src/io/checkpoint.cpp: checkpoint_read, what a resumed run opens). HDF5's
// own decoder of a corrupt file is not ours to fuzz, so at start-up a valid checkpoint of a tiny
// model (dense, or Qwen3-MoE with a router bias) is written by checkpoint_write, and each input
// is a list of edits made to a copy of it through the HDF5 library: root attributes removed or
// rewritten with another type or value, tensors removed, replaced by another type or shape, by a
// group or a compact dataset, their checksum changed or removed, values overwritten, LoRA
// attributes added, router bias datasets altered. The reader may only refuse the result with a
// UserError (CheckpointMismatch included); an unedited copy must read back exactly.
// One MPI rank (MPI_Init in LLVMFuzzerInitialize), as `qtrain` on one process.
#include <hdf5.h>
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_hdf5.h"
#include "fuzz_util.h"
#include "io/hdf5_util.h"
#include "qtrain/checkpoint.h"
#include "qtrain/comm.h"
#include "qtrain/error.h"
#include "qtrain/mesh.h"
#include "qtrain/model_config.h"
#include "qtrain/params.h"

namespace {

using qt::fuzz::Bytes;

qt::ModelConfig tiny_model(bool moe) {
  qt::ModelConfig m;
  m.preset = "custom";
  m.vocab_size = 11;
  m.hidden_size = 4;
  m.intermediate_size = 6;
  m.num_layers = 2;
  m.num_heads = 2;
  m.num_kv_heads = 1;
  m.head_dim = 2;
  m.tie_word_embeddings = !moe;
  if (moe) {
    m.num_experts = 3;
    m.num_experts_per_tok = 2;
    m.moe_intermediate_size = 2;
    m.mlp_only_layers = {0};
  }
  return m;
}

struct Case {
  qt::ModelConfig model;
  std::unique_ptr<qt::ParamLayout> layout;
  std::vector<float> params, m, v;  // as written
  qt::TrainState state;
  std::string bytes;  // the file checkpoint_write made
};

std::unique_ptr<qt::Mesh> g_mesh;
Case g_cases[2];

void make_case(Case& c, bool moe) {
  c.model = tiny_model(moe);
  c.layout = std::make_unique<qt::ParamLayout>(c.model);
  const std::size_t n = c.layout->numel();
  c.params.resize(n);
  c.m.resize(n);
  c.v.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    c.params[i] = 0.01f * static_cast<float>(i % 97) - 0.3f;
    c.m[i] = 0.001f * static_cast<float>(i % 13);
    c.v[i] = 0.0001f * static_cast<float>(i % 7);
  }
  c.state.step = 3;
  c.state.samples_consumed = 24;
  c.state.tokens_consumed = 192;
  c.state.seed = 7;
  c.state.rng_counter = 5;
  if (moe)
    c.state.router_bias.assign(static_cast<std::size_t>(c.model.num_moe_layers()) * 3, 0.25f);
  const std::string path = (qt::fuzz::scratch_dir() / (moe ? "base_moe.h5" : "base.h5")).string();
  qt::MomentShard ms{qt::Range{0, n}, c.m.data(), c.v.data()};
  qt::checkpoint_write(path, *g_mesh, *c.layout, c.params.data(), ms, c.state, c.model,
                       "[model]\npreset = custom\n");
  std::ifstream f(path, std::ios::binary);
  c.bytes.assign(std::istreambuf_iterator<char>(f), {});
  QT_FUZZ_ASSERT(!c.bytes.empty(), "the base checkpoint was not written");
}

const char* const kRootAttrs[] = {"format",
                                  "format_version",
                                  "step",
                                  "samples_consumed",
                                  "tokens_consumed",
                                  "seed",
                                  "rng_counter",
                                  "deck",
                                  "vocab_size",
                                  "hidden_size",
                                  "intermediate_size",
                                  "num_layers",
                                  "num_heads",
                                  "num_kv_heads",
                                  "head_dim",
                                  "rope_theta",
                                  "rms_norm_eps",
                                  "tie_word_embeddings",
                                  "num_experts",
                                  "num_experts_per_tok",
                                  "moe_intermediate_size",
                                  "norm_topk_prob",
                                  "decoder_sparse_step",
                                  "mlp_only_layers",
                                  "lora_r",
                                  "lora_alpha",
                                  "lora_dropout",
                                  "lora_targets",
                                  "lora_base_init",
                                  "lora_base_seed"};
const char* const kGroups[] = {"params", "optim/exp_avg", "optim/exp_avg_sq"};

// Writes attribute `name` of `loc` (replacing it) with a type and value chosen by the input.
void write_attr(hid_t loc, const char* name, Bytes& in) {
  using T = qt::fuzz::AttrType;
  constexpr T kTypes[] = {T::kI64, T::kU64, T::kF64, T::kFixedString, T::kI8, T::kI64, T::kF32};
  const std::uint8_t kind = in.u8() % 7;
  qt::fuzz::Attr a;
  a.type = kTypes[kind];
  a.pair = kind == 5;
  a.bits = in.flag() ? in.u64() : in.u8();
  a.real = static_cast<double>(static_cast<std::int64_t>(a.bits)) / 4;
  a.text = in.take(in.u8() % 24);
  if (kind == 3 && in.flag())
    a.type = T::kVarString;
  else if (kind == 3)
    a.text.push_back('\0');  // a fixed string of the text and its NUL
  qt::fuzz::write_attr(loc, name, a);
}

// Replaces dataset `where` by another dataset (other type, rank or shape, compact or not) or a
// group.
void replace_dataset(hid_t file, const std::string& where, Bytes& in) {
  H5Ldelete(file, where.c_str(), H5P_DEFAULT);
  const std::uint8_t kind = in.u8() % 6;
  if (kind == 5) {
    H5Gclose(H5Gcreate2(file, where.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
    return;
  }
  const int rank = in.u8() % 4;
  hsize_t dims[3];
  hsize_t n = 1;
  for (int k = 0; k < rank; ++k) n *= (dims[k] = static_cast<hsize_t>(in.range(0, 12)));
  const qt::h5::Handle type(H5Tcopy(kind == 0   ? H5T_IEEE_F64LE
                                : kind == 1 ? H5T_STD_I32LE
                                : kind == 2 ? H5T_IEEE_F32BE
                                            : H5T_IEEE_F32LE),
                        H5Tclose);
  const qt::h5::Handle space(
      rank == 0 ? H5Screate(H5S_SCALAR) : H5Screate_simple(rank, dims, nullptr), H5Sclose);
  const qt::h5::Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  if (kind == 4) H5Pset_layout(dcpl, H5D_COMPACT);
  const qt::h5::Handle ds(
      H5Dcreate2(file, where.c_str(), type, space, H5P_DEFAULT, dcpl, H5P_DEFAULT), H5Dclose);
  if (ds.valid()) {
    if (in.flag()) {  // values; unwritten ones read as the fill value
      std::vector<float> x(n);
      for (auto& v : x) v = static_cast<float>(static_cast<std::int8_t>(in.u8())) / 8;
      if (in.u8() == 0xFF && n > 0) x[0] = std::numeric_limits<float>::infinity();
      H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, x.data());
    }
    if (in.flag()) write_attr(ds, "checksum", in);
  }
}

// The path of a tensor of the case chosen by the input: a group's tensor or a router bias.
std::string pick_tensor(const Case& c, Bytes& in) {
  const auto& ps = c.layout->params();
  const std::size_t nt = ps.size();
  const std::size_t layers = static_cast<std::size_t>(c.model.num_layers);
  const std::size_t k = in.u8() % (3 * nt + layers + 1);
  if (k < 3 * nt) return std::string("/") + kGroups[k / nt] + "/" + ps[k % nt].name;
  if (k == 3 * nt + layers) return "/router_bias";
  return "/router_bias/model.layers." + std::to_string(k - 3 * nt) + ".mlp.gate.expert_bias";
}

void edit(hid_t file, const Case& c, Bytes& in) {
  const std::uint8_t op = in.u8() % 8;
  switch (op) {
    case 0: {  // remove a root attribute
      const char* name = kRootAttrs[in.u8() % std::size(kRootAttrs)];
      if (H5Aexists(file, name) > 0) H5Adelete(file, name);
      break;
    }
    case 1:  // rewrite a root attribute
    case 2:
      write_attr(file, kRootAttrs[in.u8() % std::size(kRootAttrs)], in);
      break;
    case 3: {  // remove a tensor (or a group: every tensor under it)
      const std::string where =
          in.flag() ? pick_tensor(c, in) : std::string("/") + kGroups[in.u8() % 3];
      if (H5Lexists(file, where.c_str(), H5P_DEFAULT) > 0)
        H5Ldelete(file, where.c_str(), H5P_DEFAULT);
      break;
    }
    case 4: {
      const std::string where = pick_tensor(c, in);
      if (H5Lexists(file, "/router_bias", H5P_DEFAULT) > 0 || where.rfind("/router_bias", 0) != 0)
        replace_dataset(file, where, in);
      break;
    }
    case 5: {  // the checksum attribute of a tensor: removed or rewritten
      const std::string where = pick_tensor(c, in);
      hid_t ds = H5Oopen(file, where.c_str(), H5P_DEFAULT);
      if (ds < 0) break;
      if (in.flag() && H5Aexists(ds, "checksum") > 0)
        H5Adelete(ds, "checksum");
      else
        write_attr(ds, "checksum", in);
      H5Oclose(ds);
      break;
    }
    default: {  // overwrite a few values of a tensor in place
      const std::string where = pick_tensor(c, in);
      hid_t ds = H5Oopen(file, where.c_str(), H5P_DEFAULT);
      if (ds < 0) break;
      if (H5Iget_type(ds) == H5I_DATASET) {
        hid_t space = H5Dget_space(ds);
        const hssize_t n = H5Sget_simple_extent_npoints(space);
        if (n > 0) {
          hsize_t at = in.u8() % static_cast<hsize_t>(n);
          const hsize_t one = 1;
          hid_t mspace = H5Screate_simple(1, &one, nullptr);
          const int rank = H5Sget_simple_extent_ndims(space);
          std::vector<hsize_t> dims(static_cast<std::size_t>(std::max(rank, 0))),
              coord(dims.size());
          H5Sget_simple_extent_dims(space, dims.data(), nullptr);
          for (int k = rank - 1; k >= 0; --k) coord[k] = at % dims[k], at /= dims[k];
          if (rank > 0) H5Sselect_elements(space, H5S_SELECT_SET, 1, coord.data());
          const float values[] = {1.5f, -0.0f, std::numeric_limits<float>::quiet_NaN(),
                                  std::numeric_limits<float>::infinity(), 1e30f};
          const float x = values[in.u8() % 5];
          H5Dwrite(ds, H5T_NATIVE_FLOAT, mspace, space, H5P_DEFAULT, &x);
          H5Sclose(mspace);
        }
        H5Sclose(space);
      }
      H5Oclose(ds);
      break;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  MPI_Init(argc, argv);
  MPI_Comm world;
  MPI_Comm_dup(MPI_COMM_WORLD, &world);
  g_mesh = std::make_unique<qt::Mesh>(qt::MeshShape{},
                                      std::make_shared<qt::MpiComm>(world, "world", true));
  make_case(g_cases[0], false);
  make_case(g_cases[1], true);
  std::atexit([] {
    g_mesh.reset();
    MPI_Finalize();
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Bytes in(data, size);
  const Case& c = g_cases[in.u8() & 1];
  const std::string path = qt::fuzz::write_scratch("step_00000003.h5", c.bytes);
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  const int edits = in.u8() % 5;
  if (edits > 0) {
    hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    QT_FUZZ_ASSERT(file >= 0, "cannot reopen the copy " + path);
    for (int k = 0; k < edits; ++k) edit(file, c, in);
    H5Fclose(file);
  }
  const std::size_t n = c.layout->numel();
  std::vector<float> params(n), m(n), v(n);
  qt::TrainState st;
  try {
    st = qt::checkpoint_read(path, *g_mesh, *c.layout, params.data(),
                             qt::MomentShard{qt::Range{0, n}, m.data(), v.data()}, c.model);
  } catch (const qt::UserError&) {
    QT_FUZZ_ASSERT(edits > 0, "the unedited checkpoint was refused");
    return 0;
  }
  if (edits == 0) {
    QT_FUZZ_ASSERT(std::memcmp(params.data(), c.params.data(), n * 4) == 0 &&
                       std::memcmp(m.data(), c.m.data(), n * 4) == 0 &&
                       std::memcmp(v.data(), c.v.data(), n * 4) == 0 &&
                       st.router_bias == c.state.router_bias && st.step == c.state.step,
                   "the unedited checkpoint reads back other values");
  }
  return 0;
}
