// The collective descriptions that both engines exchange before moving data, and the checks on
// them (see comm_checks.hpp). Every rank runs the same checks over the same descriptions in rank
// order, so every rank throws the same message.
#include "comm_checks.hpp"

#include <cstdlib>
#include <cstring>
#include <numeric>
#include <sstream>

#include "fp8moe/error.hpp"

namespace fp8moe::comm_detail {

const char* op_name(Op op) {
  switch (op) {
    case Op::barrier: return "barrier";
    case Op::split: return "split";
    case Op::all_to_all_v: return "all_to_all_v";
    case Op::all_gather: return "all_gather";
    case Op::reduce_scatter: return "reduce_scatter";
    case Op::all_reduce: return "all_reduce";
    case Op::broadcast: return "broadcast";
  }
  return "?";
}

namespace {

// Little-endian int64 fields, then the problem string: the ranks of one job share a byte order.
void put(std::string& s, int64_t v) { s.append(reinterpret_cast<const char*>(&v), sizeof v); }
void put(std::string& s, const std::vector<int64_t>& v) {
  put(s, int64_t(v.size()));
  for (int64_t x : v) put(s, x);
}

struct Reader {
  std::string_view b;
  size_t at = 0;
  int64_t get() {
    FP8MOE_CHECK(at + sizeof(int64_t) <= b.size(), "comm: a collective description of " << b.size()
                                                        << " bytes is truncated (ranks built from different sources?)");
    int64_t v;
    std::memcpy(&v, b.data() + at, sizeof v);
    at += sizeof v;
    return v;
  }
  std::vector<int64_t> get_vec() {
    int64_t n = get();
    FP8MOE_CHECK(n >= 0 && size_t(n) <= (b.size() - at) / sizeof(int64_t), "comm: a collective description is corrupt");
    std::vector<int64_t> v(static_cast<size_t>(n));
    for (auto& x : v) x = get();
    return v;
  }
};

std::string shape_str(const OpDesc& d) {
  std::ostringstream os;
  os << "[" << d.rows;
  for (int64_t x : d.row_shape) os << ", " << x;
  os << "] " << (d.dtype < 0 ? std::string_view("-") : dtype_name(DType(d.dtype)));
  return os.str();
}

// Argument errors of one tensor, "" when fine. A tensor without elements may have no data.
std::string tensor_problem(const TensorView& t, const char* arg) {
  std::ostringstream os;
  if (t.numel() > 0 && t.data == nullptr) os << arg << " " << t.str() << " has no data";
  else if (!t.is_contiguous()) os << arg << " " << t.str() << " is not contiguous";
  return os.str();
}

std::vector<int64_t> row_shape_of(const TensorView& t) {
  std::vector<int64_t> r;
  for (int d = 1; d < t.ndim; ++d) r.push_back(t.shape[d]);
  return r;
}

OpDesc describe(Op op, const TensorView& t) {
  OpDesc d;
  d.op = op;
  d.dtype = int32_t(t.dtype);
  d.row_shape = row_shape_of(t);
  d.rows = rows_of(t);
  // Packed E5M6 (two values in three bytes) has a byte address only for an even number of values.
  int64_t per_row = 1;
  for (int i = 1; i < t.ndim; ++i) per_row *= t.shape[i];
  if (t.dtype == DType::e5m6 && per_row % 2 != 0)
    d.problem = t.str() + ": packed e5m6 rows need an even number of values to be exchanged by row";
  return d;
}

// Appends a problem to d, "; "-separated.
void add_problem(OpDesc& d, const std::string& p) {
  if (p.empty()) return;
  if (!d.problem.empty()) d.problem += "; ";
  d.problem += p;
}

// send and recv agree in dtype and row shape.
void check_pair(OpDesc& d, const TensorView& send, const TensorView& recv) {
  add_problem(d, tensor_problem(send, "send"));
  add_problem(d, tensor_problem(recv, "recv"));
  if (send.dtype != recv.dtype || row_shape_of(send) != row_shape_of(recv)) {
    add_problem(d, "send " + send.str() + " and recv " + recv.str() + " differ in dtype or row shape");
  }
}

// `all` [size * n, ...] stacks one `part` [n, ...] per rank.
void check_stacked(OpDesc& d, const TensorView& all, const char* all_arg, const TensorView& part, const char* part_arg,
                   int size) {
  if (rows_of(all) == size * rows_of(part)) return;
  add_problem(d, std::string(all_arg) + " " + all.str() + " needs " + std::to_string(size * rows_of(part)) + " rows (" +
                     std::to_string(size) + " ranks x " + part_arg + "'s " + std::to_string(rows_of(part)) + ")");
}

void check_counts(OpDesc& d, std::span<const int64_t> counts, const char* arg, int64_t rows, const char* tensor,
                  int size) {
  std::ostringstream os;
  if (int64_t(counts.size()) != size) {
    os << arg << " has " << counts.size() << " entries, expected " << size << " (one per rank)";
  } else {
    int64_t sum = 0;
    for (size_t j = 0; j < counts.size(); ++j) {
      if (counts[j] < 0) {
        os << arg << "[" << j << "] = " << counts[j] << " is negative";
        break;
      }
      sum += counts[j];
    }
    if (os.tellp() == 0 && sum != rows) os << arg << " sum to " << sum << " rows but " << tensor << " has " << rows << " rows";
  }
  add_problem(d, os.str());
}

}  // namespace

std::string OpDesc::encode() const {
  std::string s;
  put(s, int64_t(op));
  put(s, dtype);
  put(s, row_shape);
  put(s, rows);
  put(s, root);
  put(s, send_counts);
  put(s, recv_counts);
  s += problem;
  return s;
}

OpDesc OpDesc::decode(std::string_view bytes) {
  Reader r{bytes};
  OpDesc d;
  d.op = Op(r.get());
  d.dtype = int32_t(r.get());
  d.row_shape = r.get_vec();
  d.rows = r.get();
  d.root = r.get();
  d.send_counts = r.get_vec();
  d.recv_counts = r.get_vec();
  d.problem = std::string(bytes.substr(r.at));
  return d;
}

int64_t rows_of(const TensorView& t) { return t.ndim == 0 ? 1 : t.shape[0]; }

int64_t row_bytes(const TensorView& t) {
  int64_t n = 1;
  for (int d = 1; d < t.ndim; ++d) n *= t.shape[d];
  return int64_t(dtype_bytes(t.dtype, n));
}

bool summable(DType t) {
  return t == DType::f32 || t == DType::f64 || t == DType::bf16 || t == DType::i32 || t == DType::i64;
}

OpDesc describe_all_to_all_v(const TensorView& send, std::span<const int64_t> send_counts, const TensorView& recv,
                             std::span<const int64_t> recv_counts, int size) {
  OpDesc d = describe(Op::all_to_all_v, send);
  d.send_counts.assign(send_counts.begin(), send_counts.end());
  d.recv_counts.assign(recv_counts.begin(), recv_counts.end());
  check_pair(d, send, recv);
  check_counts(d, send_counts, "send_counts", rows_of(send), "send", size);
  check_counts(d, recv_counts, "recv_counts", rows_of(recv), "recv", size);
  return d;
}

OpDesc describe_all_gather(const TensorView& send, const TensorView& recv, int size) {
  OpDesc d = describe(Op::all_gather, send);
  check_pair(d, send, recv);
  check_stacked(d, recv, "recv", send, "send", size);
  return d;
}

OpDesc describe_reduce_scatter(const TensorView& send, const TensorView& recv, int size) {
  OpDesc d = describe(Op::reduce_scatter, recv);
  check_pair(d, send, recv);
  if (!summable(send.dtype)) add_problem(d, "send " + send.str() + ": sums are f32 | f64 | bf16 | i32 | i64");
  check_stacked(d, send, "send", recv, "recv", size);
  return d;
}

OpDesc describe_all_reduce(const TensorView& t) {
  OpDesc d = describe(Op::all_reduce, t);
  add_problem(d, tensor_problem(t, "t"));
  if (!summable(t.dtype)) add_problem(d, "t " + t.str() + ": sums are f32 | f64 | bf16 | i32 | i64");
  return d;
}

OpDesc describe_broadcast(const TensorView& t, int root, int size) {
  OpDesc d = describe(Op::broadcast, t);
  d.root = root;
  add_problem(d, tensor_problem(t, "t"));
  if (root < 0 || root >= size) add_problem(d, "root = " + std::to_string(root) + ", expected 0.." + std::to_string(size - 1));
  return d;
}

void agree(const OpDesc& mine, const ExchangeFn& exchange, std::string_view engine) {
  std::vector<std::string> bytes = exchange(mine.encode());
  std::vector<OpDesc> all;
  all.reserve(bytes.size());
  for (const auto& b : bytes) all.push_back(OpDesc::decode(b));
  const int size = int(all.size());
  const OpDesc& d0 = all[0];
  std::ostringstream os;
  os << engine << " " << op_name(mine.op) << ": ";
  const auto head = os.str();

  for (int r = 1; r < size; ++r) {
    FP8MOE_CHECK(all[r].op == d0.op, head << "rank 0 is in " << op_name(d0.op) << " but rank " << r << " is in "
                                          << op_name(all[r].op) << " (every rank calls the same collectives in the same order)");
  }
  std::string problems;
  for (int r = 0; r < size; ++r) {
    if (!all[r].problem.empty()) problems += (problems.empty() ? "" : "; ") + ("rank " + std::to_string(r) + ": " + all[r].problem);
  }
  FP8MOE_CHECK(problems.empty(), head << problems);
  if (d0.op == Op::barrier || d0.op == Op::split) return;

  for (int r = 1; r < size; ++r) {
    const OpDesc& d = all[r];
    // all_to_all_v's rows differ by rank; the other collectives pass the same shape everywhere.
    const bool same_rows = d0.op == Op::all_to_all_v || d.rows == d0.rows;
    FP8MOE_CHECK(d.dtype == d0.dtype && d.row_shape == d0.row_shape && same_rows,
                 head << "rank 0 passes " << shape_str(d0) << " but rank " << r << " passes " << shape_str(d)
                      << " (every rank passes the same dtype and " << (d0.op == Op::all_to_all_v ? "row shape" : "shape")
                      << ")");
    FP8MOE_CHECK(d.root == d0.root, head << "rank 0 names root " << d0.root << " but rank " << r << " names root " << d.root);
  }
  if (d0.op == Op::all_to_all_v) {
    for (int i = 0; i < size; ++i) {
      for (int j = 0; j < size; ++j) {
        const int64_t sent = all[i].send_counts[j], expected = all[j].recv_counts[i];
        FP8MOE_CHECK(sent == expected, head << "send_counts[" << j << "] = " << sent << " on rank " << i << " but recv_counts["
                                            << i << "] = " << expected << " on rank " << j
                                            << " (the rows rank " << i << " sends rank " << j << " are the rows rank " << j
                                            << " expects from rank " << i << ")");
      }
    }
  }
}

double timeout_s() {
  const char* s = std::getenv("FP8MOE_COMM_TIMEOUT_S");
  if (s == nullptr || *s == '\0') return 300.0;
  char* end = nullptr;
  const double v = std::strtod(s, &end);
  FP8MOE_CHECK(end != s && *end == '\0' && v > 0, "FP8MOE_COMM_TIMEOUT_S = '" << s << "': expected a positive number of seconds");
  return v;
}

}  // namespace fp8moe::comm_detail
