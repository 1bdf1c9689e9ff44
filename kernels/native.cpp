// Eager calls replayed from recipes, in C++ (built and loaded by kernels/native.py).
//
// A recipe is what a kernel family's host code did for one call signature, recorded once
// (kernels/native.py): the buffers it allocated, the Triton kernels it launched with their grids
// and arguments (each pointer argument as a slot — an input tensor or a buffer — and a byte
// offset into it), and the outputs it returned as views of its buffers. Replaying one allocates
// the buffers through the caching allocator, binds the addresses and calls cuLaunchKernel: no
// Python between the call and the launches. A plan holds the forward recipe of a signature, the
// backward recipes recorded so far (one per output-gradient layout and bias-gradient flag) and
// which tensors the backward keeps; a missing backward recipe is recorded by one Python callable
// (the recorder, set once). Autograd runs through a C++ autograd function, whose round trip costs
// a fraction of a Python autograd.Function's. Plans are reference counted: the table of live
// plans and each forward's autograd node hold one.
//
// Invariants the Python side guarantees when it builds a recipe: every pointer argument lies in
// one slot's allocation; every output is a view of a buffer in the buffer's dtype; kernels need no
// scratch, no cluster, no cooperative or programmatic launch; scalar arguments are stored as the
// little-endian bits of their C type (1, 2, 4 or 8 bytes); a TMA descriptor argument (the Gluon
// kernels) is its tensor map, encoded per call at the argument's address from the recorded fixed
// part, followed by its shape and strides as scalars (Triton 3.6's expanded launcher arguments).
#include <torch/extension.h>

#include <dlfcn.h>

#include <array>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Opt = std::optional<at::Tensor>;

constexpr int kSlots = 6;  // tensor inputs of an op at most (attention's q, k, v, bias, and room)

// --- the CUDA driver, opened as Triton's launcher opens it (no link-time dependency)

using CUresult = int;
using LaunchFn = CUresult (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                              void**, void**);
using ErrorStringFn = CUresult (*)(CUresult, const char**);
using CtxGetCurrentFn = CUresult (*)(void**);
using CtxSetCurrentFn = CUresult (*)(void*);
using DeviceGetFn = CUresult (*)(int*, int);
using PrimaryCtxRetainFn = CUresult (*)(void**, int);
// cuTensorMapEncodeTiled (its enums are ints)
using EncodeFn = CUresult (*)(void*, int, unsigned, void*, const uint64_t*, const uint64_t*, const uint32_t*,
                              const uint32_t*, int, int, int, int);

struct Driver {
  LaunchFn launch = nullptr;
  ErrorStringFn error_string = nullptr;
  CtxGetCurrentFn ctx_get_current = nullptr;
  CtxSetCurrentFn ctx_set_current = nullptr;
  DeviceGetFn device_get = nullptr;
  PrimaryCtxRetainFn primary_ctx_retain = nullptr;
  EncodeFn encode = nullptr;
};

const Driver& driver() {
  static Driver d = [] {
    Driver out;
    void* lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_LAZY);
    TORCH_CHECK(lib != nullptr, "elsa_vision native launches: cannot open libcuda.so.1");
    out.launch = reinterpret_cast<LaunchFn>(dlsym(lib, "cuLaunchKernel"));
    out.error_string = reinterpret_cast<ErrorStringFn>(dlsym(lib, "cuGetErrorString"));
    out.ctx_get_current = reinterpret_cast<CtxGetCurrentFn>(dlsym(lib, "cuCtxGetCurrent"));
    out.ctx_set_current = reinterpret_cast<CtxSetCurrentFn>(dlsym(lib, "cuCtxSetCurrent"));
    out.device_get = reinterpret_cast<DeviceGetFn>(dlsym(lib, "cuDeviceGet"));
    out.primary_ctx_retain = reinterpret_cast<PrimaryCtxRetainFn>(dlsym(lib, "cuDevicePrimaryCtxRetain_v2"));
    if (out.primary_ctx_retain == nullptr)
      out.primary_ctx_retain = reinterpret_cast<PrimaryCtxRetainFn>(dlsym(lib, "cuDevicePrimaryCtxRetain"));
    out.encode = reinterpret_cast<EncodeFn>(dlsym(lib, "cuTensorMapEncodeTiled"));
    TORCH_CHECK(out.launch && out.error_string && out.ctx_get_current && out.ctx_set_current && out.device_get &&
                    out.primary_ctx_retain,
                "elsa_vision native launches: libcuda.so.1 lacks cuLaunchKernel or the context calls");
    return out;
  }();
  return d;
}

// --- recipes

struct Arg {
  int slot;        // ≥ 0: a pointer into that slot at `bits` bytes; −1: a scalar whose bits are `bits`
  int64_t bits;
  int tma;         // ≥ 0: not the pointer but the tensor map of the launch's tma[tma] at that address
};

// A TMA tensor map's fixed part, as Triton 3.6's fill_tma_descriptor passes it to
// cuTensorMapEncodeTiled (dims, strides and box innermost first; strides in bytes, rank − 1 of them;
// no interleave, L2 promotion 128 B, element strides 1): only the address changes between calls.
struct Tma {
  int type, rank, swizzle, fill;
  std::array<uint64_t, 5> dims, strides;
  std::array<uint32_t, 5> box;
};

struct alignas(128) TensorMap {
  uint64_t words[16];
};

struct Launch {
  uint64_t function;
  std::array<unsigned, 3> grid;
  unsigned block, shared;
  std::vector<Arg> args;
  std::vector<Tma> tma;
};

struct Buffer {  // allocated as the host body allocated it: sizes, strides, dtype
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
};

struct Output {
  int slot;  // −1: None
  std::vector<int64_t> sizes, strides;
  int64_t offset;
};

struct Recipe {
  int inputs = 0;  // slots [0, inputs) are the call's tensors (undefined for None)
  std::vector<Buffer> buffers;
  std::vector<Launch> launches;
  std::vector<Output> outputs;
};

// The outputs of `r` for `inputs`, its launches made on `stream`.
std::vector<at::Tensor> run(const Recipe& r, const std::vector<at::Tensor>& inputs, int64_t stream,
                            const at::TensorOptions& device) {
  TORCH_CHECK(static_cast<int>(inputs.size()) == r.inputs, "elsa_vision native replay: ", inputs.size(),
              " tensors given, the recipe takes ", r.inputs);
  std::vector<at::Tensor> slots(inputs);
  std::vector<uint64_t> base(inputs.size() + r.buffers.size(), 0);
  for (size_t i = 0; i < inputs.size(); ++i)
    if (inputs[i].defined()) base[i] = reinterpret_cast<uint64_t>(inputs[i].data_ptr());
  for (const Buffer& b : r.buffers) {
    slots.push_back(at::empty_strided(b.sizes, b.strides, device.dtype(b.dtype)));
    base[slots.size() - 1] = reinterpret_cast<uint64_t>(slots.back().data_ptr());
  }
  if (!r.launches.empty()) {
    const Driver& d = driver();
    void* ctx = nullptr;
    d.ctx_get_current(&ctx);
    if (ctx == nullptr) {  // (a thread that made no CUDA call yet: the device's primary context, as Triton does)
      int dev = 0;
      TORCH_CHECK(device.device().is_cuda() && d.device_get(&dev, device.device().index()) == 0 &&
                      d.primary_ctx_retain(&ctx, dev) == 0 && d.ctx_set_current(ctx) == 0,
                  "elsa_vision native replay: no CUDA context for device ", device.device());
    }
    std::vector<uint64_t> values;
    std::vector<void*> params;
    std::vector<TensorMap> maps;
    static const uint32_t unit[5] = {1, 1, 1, 1, 1};
    for (const Launch& l : r.launches) {
      values.resize(l.args.size());
      params.resize(l.args.size());
      maps.resize(l.tma.size());
      for (size_t i = 0; i < l.args.size(); ++i) {
        const Arg& a = l.args[i];
        values[i] = a.slot >= 0 ? base[a.slot] + static_cast<uint64_t>(a.bits) : static_cast<uint64_t>(a.bits);
        params[i] = &values[i];  // (little-endian: a narrower scalar is the low bytes of its slot)
        if (a.tma >= 0) {
          const Tma& t = l.tma[a.tma];
          TORCH_CHECK(d.encode != nullptr, "elsa_vision native replay: libcuda.so.1 lacks cuTensorMapEncodeTiled");
          CUresult err = d.encode(&maps[a.tma], t.type, t.rank, reinterpret_cast<void*>(values[i]), t.dims.data(),
                                  t.strides.data(), t.box.data(), unit, 0, t.swizzle, 2, t.fill);
          if (err != 0) {
            const char* what = nullptr;
            d.error_string(err, &what);
            TORCH_CHECK(false, "elsa_vision native replay: cuTensorMapEncodeTiled failed: ",
                        what ? what : "unknown error");
          }
          params[i] = &maps[a.tma];
        }
      }
      CUresult err = d.launch(reinterpret_cast<void*>(l.function), l.grid[0], l.grid[1], l.grid[2], l.block, 1, 1,
                              l.shared, reinterpret_cast<void*>(stream), params.data(), nullptr);
      if (err != 0) {
        const char* what = nullptr;
        d.error_string(err, &what);
        TORCH_CHECK(false, "elsa_vision native replay: cuLaunchKernel failed: ", what ? what : "unknown error");
      }
    }
  }
  std::vector<at::Tensor> out;
  out.reserve(r.outputs.size());
  for (const Output& o : r.outputs) {
    if (o.slot < 0) {
      out.emplace_back();
      continue;
    }
    const at::Tensor& b = slots[o.slot];
    // (an output that is its buffer as allocated is returned as that tensor, as the host body returns it)
    bool whole = o.offset == b.storage_offset() && b.sizes().equals(o.sizes) && b.strides().equals(o.strides);
    out.push_back(whole ? b : b.as_strided(o.sizes, o.strides, o.offset));
  }
  return out;
}

// --- plans

// (plan, dout, saved tensors, bias_grad) → the gradients: kernels/native.py's _record_backward, which
// runs the Python backward and records its recipe. Set once and never released: Python objects are
// not touched where a plan dies, which may be on an autograd thread without the GIL.
py::object* recorder = nullptr;

struct Plan : torch::CustomClassHolder {
  int64_t id = -1;
  Recipe forward;
  // backward recipes by (bias gradient wanted, the output gradient's dtype, alignment, strides)
  std::map<std::vector<int64_t>, std::shared_ptr<Recipe>> backward;
  std::vector<int> saved;   // the backward's tensors: indices into (inputs..., outputs...), −1 for None
  int differentiable = 0;   // inputs whose gradients the backward returns first, in order
  int bias = -1;            // the input whose gradient is computed only when it requires one (−1: none)
  std::string what;         // the public function, for errors
  std::mutex lock;
};

// Plans by id. A forward's autograd node holds its plan too (a capsule in its saved data), so a plan
// released here (release(): Python forgot the signature) lives on until the graphs built from it die.
std::mutex plans_lock;
std::map<int64_t, c10::intrusive_ptr<Plan>> plans;
int64_t next_id = 0;

c10::intrusive_ptr<Plan> plan(int64_t id) {
  std::lock_guard<std::mutex> guard(plans_lock);
  auto hit = plans.find(id);
  TORCH_CHECK(hit != plans.end(), "elsa_vision native: unknown plan ", id);
  return hit->second;
}

std::vector<int64_t> backward_key(bool bias_grad, const at::Tensor& dout) {
  std::vector<int64_t> key{bias_grad, static_cast<int64_t>(dout.scalar_type()),
                           static_cast<int64_t>(reinterpret_cast<uint64_t>(dout.data_ptr()) & 15)};
  for (int64_t s : dout.strides()) key.push_back(s);
  return key;
}

std::vector<at::Tensor> inputs_of(const std::array<Opt, kSlots>& given, int n) {
  std::vector<at::Tensor> in;
  in.reserve(n);
  for (int i = 0; i < n; ++i) in.push_back(given[i].has_value() ? *given[i] : at::Tensor());
  return in;
}

struct Replay : public torch::autograd::Function<Replay> {
  static variable_list forward(AutogradContext* ctx, Opt t0, Opt t1, Opt t2, Opt t3, Opt t4, Opt t5, int64_t id,
                               int64_t stream) {
    c10::intrusive_ptr<Plan> held = plan(id);
    Plan& p = *held;
    std::vector<at::Tensor> in = inputs_of({t0, t1, t2, t3, t4, t5}, p.forward.inputs);
    at::TensorOptions device = in[0].options();
    std::vector<at::Tensor> out = run(p.forward, in, stream, device);
    variable_list saved;
    saved.reserve(p.saved.size());
    for (int i : p.saved) {
      int n = static_cast<int>(in.size());
      saved.push_back(i < 0 ? at::Tensor() : i < n ? in[i] : out[i - n]);
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["plan"] = c10::IValue::make_capsule(held);
    // (autograd runs a node's backward on its forward's stream)
    ctx->saved_data["stream"] = stream;
    ctx->mark_non_differentiable({out[1]});
    // (autograd would otherwise fill a zero tensor the statistics' size at every backward)
    ctx->set_materialize_grads(false);
    return {out[0], out[1]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto held = c10::static_intrusive_pointer_cast<Plan>(ctx->saved_data["plan"].toCapsule());
    Plan& p = *held;
    TORCH_CHECK(!at::GradMode::is_enabled(), "elsa_vision.", p.what,
                " does not support double backward (gradients of gradients). Use backend='reference' for "
                "higher-order derivatives.");
    variable_list none(kSlots + 2);
    const at::Tensor& dout = grads[0];
    if (!dout.defined()) return none;  // (no gradient reached the output: none for the inputs)
    variable_list saved = ctx->get_saved_variables();
    // (the inputs before the bias are tensors, so its index among the forward's arguments is p.bias; the
    // saved tensors begin with those inputs, so it is the bias's index there too)
    bool bias_grad = p.bias >= 0 && saved[p.bias].defined() && ctx->needs_input_grad(p.bias);
    std::shared_ptr<Recipe> recipe;
    std::vector<int64_t> key = backward_key(bias_grad, dout);
    {
      std::lock_guard<std::mutex> guard(p.lock);
      auto hit = p.backward.find(key);
      if (hit != p.backward.end()) recipe = hit->second;
    }
    std::vector<at::Tensor> result;
    if (recipe) {
      std::vector<at::Tensor> in{dout};
      in.insert(in.end(), saved.begin(), saved.end());
      result = run(*recipe, in, ctx->saved_data["stream"].toInt(), dout.options());
    } else {  // the Python body, which records this layout's recipe for the next call
      py::gil_scoped_acquire gil;
      py::list kept;
      for (const at::Tensor& t : saved) kept.append(t.defined() ? py::cast(t) : py::none());
      TORCH_CHECK(recorder != nullptr, "elsa_vision native replay: no recorder set");
      py::object out = (*recorder)(p.id, dout, kept, bias_grad);
      for (py::handle g : out) result.push_back(g.is_none() ? at::Tensor() : g.cast<at::Tensor>());
    }
    TORCH_CHECK(static_cast<int>(result.size()) == p.differentiable + 1, "elsa_vision native replay: the backward "
                "of ", p.what, " returned ", result.size(), " gradients, expected ", p.differentiable + 1);
    for (int i = 0; i < p.differentiable; ++i) none[i] = result[i];
    if (bias_grad) none[p.bias] = result[p.differentiable];
    return none;
  }
};

// --- the Python interface

using LaunchSpec = std::tuple<uint64_t, std::vector<int64_t>, std::vector<int64_t>, std::vector<std::vector<int64_t>>>;
using OutputSpec = std::tuple<int, std::vector<int64_t>, std::vector<int64_t>, int64_t>;
using BufferSpec = std::tuple<std::vector<int64_t>, std::vector<int64_t>, int64_t>;

Recipe recipe_from(int inputs, const std::vector<BufferSpec>& buffers, const std::vector<LaunchSpec>& launches,
                   const std::vector<OutputSpec>& outputs) {
  // launches: (function, [grid x, y, z, block, shared], [slot, bits, tma, slot, bits, tma, ...],
  //            [[type, rank, swizzle, fill, dims × 5, strides × 5, box × 5], ...])
  Recipe r;
  r.inputs = inputs;
  for (const auto& [sizes, strides, dtype] : buffers) {
    TORCH_CHECK(sizes.size() == strides.size(), "elsa_vision native: malformed buffer");
    r.buffers.push_back({sizes, strides, static_cast<at::ScalarType>(dtype)});
  }
  int slots = inputs + static_cast<int>(r.buffers.size());
  for (const auto& [function, shape, args, tma] : launches) {
    TORCH_CHECK(shape.size() == 5 && args.size() % 3 == 0, "elsa_vision native: malformed launch");
    Launch l{function, {static_cast<unsigned>(shape[0]), static_cast<unsigned>(shape[1]),
                        static_cast<unsigned>(shape[2])},
             static_cast<unsigned>(shape[3]), static_cast<unsigned>(shape[4]), {}, {}};
    for (const auto& t : tma) {
      TORCH_CHECK(t.size() == 19 && t[1] >= 1 && t[1] <= 5, "elsa_vision native: malformed tensor map");
      Tma m{static_cast<int>(t[0]), static_cast<int>(t[1]), static_cast<int>(t[2]), static_cast<int>(t[3]), {}, {}, {}};
      for (int i = 0; i < 5; ++i) {
        m.dims[i] = static_cast<uint64_t>(t[4 + i]);
        m.strides[i] = static_cast<uint64_t>(t[9 + i]);
        m.box[i] = static_cast<uint32_t>(t[14 + i]);
      }
      l.tma.push_back(m);
    }
    for (size_t i = 0; i < args.size(); i += 3) {
      TORCH_CHECK(args[i] < slots, "elsa_vision native: a launch argument names slot ", args[i], " of ", slots);
      TORCH_CHECK(args[i + 2] < static_cast<int64_t>(l.tma.size()) && (args[i + 2] < 0 || args[i] >= 0),
                  "elsa_vision native: a tensor-map argument without its map or address");
      l.args.push_back({static_cast<int>(args[i]), args[i + 1], static_cast<int>(args[i + 2])});
    }
    if (l.grid[0] && l.grid[1] && l.grid[2])  // (an empty grid launches nothing, as in Triton's launcher)
      r.launches.push_back(std::move(l));
  }
  for (const auto& [slot, sizes, strides, offset] : outputs) {
    TORCH_CHECK(slot < slots && (slot < 0 || slot >= inputs), "elsa_vision native: an output must be a view of a "
                "buffer, got slot ", slot);
    r.outputs.push_back({slot, sizes, strides, offset});
  }
  return r;
}

int64_t new_plan(const std::string& what, int inputs, const std::vector<BufferSpec>& buffers,
                 const std::vector<LaunchSpec>& launches, const std::vector<OutputSpec>& outputs,
                 const std::vector<int>& saved, int differentiable, int bias) {
  TORCH_CHECK(inputs >= 1 && inputs <= kSlots, "elsa_vision native: ", inputs, " inputs, at most ", kSlots);
  TORCH_CHECK(outputs.size() == 2, "elsa_vision native: a forward returns (out, statistics)");
  TORCH_CHECK(bias < static_cast<int>(saved.size()) && (bias < 0 || saved[bias] == bias || saved[bias] == -1),
              "elsa_vision native: the saved tensors must begin with the inputs up to the bias");
  auto p = c10::make_intrusive<Plan>();
  p->what = what;
  p->forward = recipe_from(inputs, buffers, launches, outputs);
  p->saved = saved;
  p->differentiable = differentiable;
  p->bias = bias;
  std::lock_guard<std::mutex> guard(plans_lock);
  p->id = next_id++;
  plans[p->id] = p;
  return p->id;
}

void release(int64_t id) {
  std::lock_guard<std::mutex> guard(plans_lock);
  plans.erase(id);
}

int64_t live_plans() {
  std::lock_guard<std::mutex> guard(plans_lock);
  return static_cast<int64_t>(plans.size());
}

void set_recorder(py::object fn) {
  if (recorder == nullptr) recorder = new py::object();
  *recorder = std::move(fn);
}

void add_backward(int64_t id, bool bias_grad, const at::Tensor& dout, int inputs,
                  const std::vector<BufferSpec>& buffers, const std::vector<LaunchSpec>& launches,
                  const std::vector<OutputSpec>& outputs) {
  c10::intrusive_ptr<Plan> p = plan(id);
  auto r = std::make_shared<Recipe>(recipe_from(inputs, buffers, launches, outputs));
  std::lock_guard<std::mutex> guard(p->lock);
  p->backward[backward_key(bias_grad, dout)] = std::move(r);
}

int64_t backward_recipes(int64_t id) {
  c10::intrusive_ptr<Plan> p = plan(id);
  std::lock_guard<std::mutex> guard(p->lock);
  return static_cast<int64_t>(p->backward.size());
}

py::tuple call(int64_t id, int64_t stream, Opt t0, Opt t1, Opt t2, Opt t3, Opt t4, Opt t5) {
  variable_list out = Replay::apply(t0, t1, t2, t3, t4, t5, id, stream);
  return py::make_tuple(out[0], out[1]);
}

py::tuple call_forward(int64_t id, int64_t stream, Opt t0, Opt t1, Opt t2, Opt t3, Opt t4, Opt t5) {
  c10::intrusive_ptr<Plan> p = plan(id);
  std::vector<at::Tensor> in = inputs_of({t0, t1, t2, t3, t4, t5}, p->forward.inputs);
  std::vector<at::Tensor> out = run(p->forward, in, stream, in[0].options());
  return py::make_tuple(out[0], out[1]);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "elsa_vision: eager calls replayed from recorded recipes (see kernels/native.py)";
  m.def("new_plan", &new_plan);
  m.def("add_backward", &add_backward);
  m.def("release", &release);
  m.def("live_plans", &live_plans);
  m.def("set_recorder", &set_recorder);
  m.def("backward_recipes", &backward_recipes);  // (how many a plan holds: tests)
  // call(plan, stream, t0, t1=None, ...): the forward with autograd; call_forward: without
  m.def("call", &call, py::arg("plan"), py::arg("stream"), py::arg("t0"), py::arg("t1") = py::none(),
        py::arg("t2") = py::none(), py::arg("t3") = py::none(), py::arg("t4") = py::none(),
        py::arg("t5") = py::none());
  m.def("call_forward", &call_forward, py::arg("plan"), py::arg("stream"), py::arg("t0"),
        py::arg("t1") = py::none(), py::arg("t2") = py::none(), py::arg("t3") = py::none(),
        py::arg("t4") = py::none(), py::arg("t5") = py::none());
}
