// The OpenAI-compatible server (server.hpp).
#include "serve/server.hpp"

#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <deque>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "fp8moe/error.hpp"
#include "serve/generate.hpp"

namespace fp8moe::serve {

using json = nlohmann::json;

std::string chat_prompt(const std::vector<std::pair<std::string, std::string>>& messages) {
  std::string p;
  for (const auto& [role, content] : messages) p += role + ": " + content + "\n";
  return p + "assistant: ";
}

size_t utf8_whole_prefix(std::string_view s) {
  // Back up over at most 3 continuation bytes to the last lead byte; keep it only if its
  // sequence is complete.
  size_t i = s.size(), back = 0;
  while (i > 0 && back < 3 && (static_cast<unsigned char>(s[i - 1]) & 0xC0) == 0x80) {
    --i;
    ++back;
  }
  if (i == 0) return s.size();
  const unsigned char lead = static_cast<unsigned char>(s[i - 1]);
  const size_t len = lead >= 0xF0 && lead < 0xF8 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
  if (len == 1 || lead >= 0xF8) return s.size();
  return back + 1 >= len ? s.size() : i - 1;
}

namespace {

using Clock = std::chrono::steady_clock;

struct HttpError {
  int status;
  std::string message, type, param, code;
};

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string error_body(const HttpError& e) {
  json err = {{"message", e.message}, {"type", e.type}};
  err["param"] = e.param.empty() ? json(nullptr) : json(e.param);
  err["code"] = e.code.empty() ? json(nullptr) : json(e.code);
  return dump(json{{"error", err}});
}

[[noreturn]] void bad(const std::string& param, const std::string& message) {
  throw HttpError{400, message, "invalid_request_error", param, ""};
}

// What a request's callbacks hand to its HTTP thread.
struct Channel {
  std::mutex mu;
  std::condition_variable cv;
  std::string text;  // made, not yet sent
  bool done = false;
  std::string reason;
  int64_t completion_tokens = 0;
  uint64_t id = 0;
};

struct Parsed {
  Request req;
  bool stream = false;
  std::string prompt;
};

double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[size_t(std::min<double>(double(v.size() - 1), std::floor(q * double(v.size() - 1) + 0.5)))];
}

}  // namespace

struct Server::Impl {
  Engine& engine;
  ServerOptions opt;
  std::unique_ptr<Scheduler> own;
  Batcher& sched;
  httplib::Server http;
  std::atomic<bool> stopping{false};
  std::mutex wake_mu;
  std::condition_variable wake_cv;
  std::mutex stats_mu;
  std::map<std::pair<std::string, int>, int64_t> requests;  // (endpoint, status) -> count
  std::deque<std::pair<Clock::time_point, int64_t>> token_history;  // (time, generated tokens)
  std::mutex live_mu;
  std::map<uint64_t, std::shared_ptr<Channel>> live;
  int64_t created = 0;

  Impl(Engine& e, const ServerOptions& o)
      : engine(e), opt(o), own(std::make_unique<Scheduler>(e, o.scheduler)), sched(*own) {
    created = int64_t(std::time(nullptr));
  }
  Impl(Engine& e, Batcher& b, const ServerOptions& o) : engine(e), opt(o), sched(b) {
    created = int64_t(std::time(nullptr));
  }

  void count(const std::string& endpoint, int status) {
    std::lock_guard<std::mutex> l(stats_mu);
    ++requests[{endpoint, status}];
  }

  Parsed parse(const std::string& body, bool chat) {
    json j;
    try {
      j = json::parse(body);
    } catch (const json::exception& e) {
      bad("", std::string("malformed JSON body: ") + e.what());
    }
    if (!j.is_object()) bad("", "the body must be a JSON object");
    Parsed p;
    const auto get_int = [&](const char* k, int64_t def, int64_t lo) {
      if (!j.contains(k) || j[k].is_null()) return def;
      if (!j[k].is_number_integer()) bad(k, std::string(k) + " must be an integer");
      const int64_t v = j[k].get<int64_t>();
      if (v < lo) bad(k, std::string(k) + " must be >= " + std::to_string(lo) + ", got " + std::to_string(v));
      return v;
    };
    const auto get_num = [&](const char* k, double def) {
      if (!j.contains(k) || j[k].is_null()) return def;
      if (!j[k].is_number()) bad(k, std::string(k) + " must be a number");
      return j[k].get<double>();
    };
    if (j.contains("model")) {
      if (!j["model"].is_string()) bad("model", "model must be a string");
      if (j["model"].get<std::string>() != opt.model)
        throw HttpError{404, "The model '" + j["model"].get<std::string>() + "' does not exist (this server has '" + opt.model + "')",
                        "invalid_request_error", "model", "model_not_found"};
    }
    if (chat) {
      if (!j.contains("messages") || !j["messages"].is_array() || j["messages"].empty())
        bad("messages", "messages must be a non-empty array of {role, content}");
      std::vector<std::pair<std::string, std::string>> m;
      for (const json& msg : j["messages"]) {
        if (!msg.is_object() || !msg.contains("role") || !msg["role"].is_string() || !msg.contains("content") ||
            !msg["content"].is_string())
          bad("messages", "every message must be an object with string role and content");
        m.emplace_back(msg["role"].get<std::string>(), msg["content"].get<std::string>());
      }
      p.prompt = chat_prompt(m);
      p.req.prompt = encode_text(p.prompt);
    } else {
      if (!j.contains("prompt")) bad("prompt", "prompt is required");
      const json& pr = j["prompt"];
      if (pr.is_string()) {
        p.prompt = pr.get<std::string>();
        p.req.prompt = encode_text(p.prompt);
      } else if (pr.is_array() && pr.size() == 1 && pr[0].is_string()) {
        p.prompt = pr[0].get<std::string>();
        p.req.prompt = encode_text(p.prompt);
      } else if (pr.is_array() && !pr.empty() && std::all_of(pr.begin(), pr.end(), [](const json& x) { return x.is_number_integer(); })) {
        for (const json& x : pr) p.req.prompt.push_back(int32_t(x.get<int64_t>()));
      } else {
        bad("prompt", "prompt must be a string, an array of one string or an array of token ids");
      }
    }
    p.req.max_tokens = get_int("max_tokens", 16, 1);
    p.req.sampling.temperature = get_num("temperature", 1.0);
    if (p.req.sampling.temperature < 0 || p.req.sampling.temperature > 2)
      bad("temperature", "temperature must be in [0, 2], got " + std::to_string(p.req.sampling.temperature));
    p.req.sampling.top_p = get_num("top_p", 1.0);
    if (!(p.req.sampling.top_p > 0 && p.req.sampling.top_p <= 1))
      bad("top_p", "top_p must be in (0, 1], got " + std::to_string(p.req.sampling.top_p));
    p.req.sampling.top_k = get_int("top_k", 0, 0);
    p.req.sampling.seed = j.contains("seed") && !j["seed"].is_null() ? uint64_t(get_int("seed", 0, 0))
                                                                    : (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
    if (j.contains("stop") && !j["stop"].is_null()) {
      const json& s = j["stop"];
      if (s.is_string()) p.req.stop = {s.get<std::string>()};
      else if (s.is_array() && s.size() <= 4 && std::all_of(s.begin(), s.end(), [](const json& x) { return x.is_string(); }))
        for (const json& x : s) p.req.stop.push_back(x.get<std::string>());
      else bad("stop", "stop must be a string or an array of at most 4 strings");
    }
    if (j.contains("stream") && !j["stream"].is_null()) {
      if (!j["stream"].is_boolean()) bad("stream", "stream must be a boolean");
      p.stream = j["stream"].get<bool>();
    }
    return p;
  }

  std::shared_ptr<Channel> submit(Parsed& p) {
    auto ch = std::make_shared<Channel>();
    p.req.on_text = [ch](std::string_view s) {
      std::lock_guard<std::mutex> l(ch->mu);
      ch->text += s;
      ch->cv.notify_all();
    };
    p.req.on_done = [this, ch](const std::string& reason, const std::vector<int32_t>& tokens) {
      {
        std::lock_guard<std::mutex> l(ch->mu);
        ch->done = true;
        ch->reason = reason;
        ch->completion_tokens = int64_t(tokens.size());
        ch->cv.notify_all();
      }
      std::lock_guard<std::mutex> l(live_mu);
      live.erase(ch->id);
    };
    {
      // Registered before the engine can finish it, so on_done always finds it.
      std::lock_guard<std::mutex> l(live_mu);
      try {
        ch->id = sched.submit(std::move(p.req));
      } catch (const Error& e) {
        const std::string m = e.what();
        throw HttpError{400, m, "invalid_request_error", m.find("context") != std::string::npos ? "prompt" : "",
                        m.find("exceeds the context") != std::string::npos ? "context_length_exceeded" : ""};
      }
      live[ch->id] = ch;
    }
    wake_cv.notify_all();
    return ch;
  }

  json choice(bool chat, const std::string& text, const json& finish, bool stream, bool first) const {
    json c = {{"index", 0}, {"finish_reason", finish}};
    if (!chat) {
      c["text"] = text;
      c["logprobs"] = nullptr;
    } else if (stream) {
      c["delta"] = first ? json{{"role", "assistant"}, {"content", text}} : json{{"content", text}};
    } else {
      c["message"] = {{"role", "assistant"}, {"content", text}};
    }
    return c;
  }

  json envelope(bool chat, bool stream, uint64_t id) const {
    return {{"id", std::string(chat ? "chatcmpl-" : "cmpl-") + std::to_string(id)},
            {"object", chat ? (stream ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
            {"created", int64_t(std::time(nullptr))},
            {"model", opt.model}};
  }

  void completion(const httplib::Request& rq, httplib::Response& rs, bool chat) {
    const std::string endpoint = chat ? "/v1/chat/completions" : "/v1/completions";
    Parsed p;
    std::shared_ptr<Channel> ch;
    try {
      p = parse(rq.body, chat);
      ch = submit(p);
    } catch (const HttpError& e) {
      rs.status = e.status;
      rs.set_content(error_body(e), "application/json");
      count(endpoint, e.status);
      return;
    }
    const int64_t prompt_tokens = int64_t(encode_text(p.prompt).size());
    count(endpoint, 200);
    if (!p.stream) {
      std::unique_lock<std::mutex> l(ch->mu);
      ch->cv.wait(l, [&] { return ch->done; });
      json j = envelope(chat, false, ch->id);
      j["choices"] = json::array({choice(chat, ch->text, ch->reason, false, true)});
      j["usage"] = {{"prompt_tokens", prompt_tokens}, {"completion_tokens", ch->completion_tokens},
                    {"total_tokens", prompt_tokens + ch->completion_tokens}};
      rs.set_content(dump(j), "application/json");
      return;
    }
    auto first = std::make_shared<bool>(true);
    rs.set_header("Cache-Control", "no-cache");
    rs.set_chunked_content_provider(
        "text/event-stream",
        [this, ch, chat, first, prompt_tokens](size_t, httplib::DataSink& sink) {
          std::unique_lock<std::mutex> l(ch->mu);
          ch->cv.wait_for(l, std::chrono::milliseconds(50), [&] { return !ch->text.empty() || ch->done; });
          const bool done = ch->done;
          const size_t n = done ? ch->text.size() : utf8_whole_prefix(ch->text);
          const std::string piece = ch->text.substr(0, n);
          ch->text.erase(0, n);
          const std::string reason = ch->reason;
          const int64_t completion = ch->completion_tokens;
          l.unlock();
          if (stopping || !sink.is_writable()) return false;  // the releaser cancels
          const auto event = [&](const json& j) {
            const std::string s = "data: " + dump(j) + "\n\n";
            return sink.write(s.data(), s.size());
          };
          if (!piece.empty() || (*first && chat)) {
            json j = envelope(chat, true, ch->id);
            j["choices"] = json::array({choice(chat, piece, nullptr, true, *first)});
            *first = false;
            if (!event(j)) return false;
          }
          if (done) {
            json j = envelope(chat, true, ch->id);
            j["choices"] = json::array({choice(chat, "", reason, true, false)});
            j["usage"] = {{"prompt_tokens", prompt_tokens}, {"completion_tokens", completion},
                          {"total_tokens", prompt_tokens + completion}};
            if (!event(j)) return false;
            const std::string end = "data: [DONE]\n\n";
            if (!sink.write(end.data(), end.size())) return false;
            sink.done();
          }
          return true;
        },
        [this, ch](bool success) {
          if (!success) {  // the client went away (or the server stops): free its request
            sched.cancel(ch->id);
            wake_cv.notify_all();
          }
        });
  }

  std::string metrics() {
    const SchedulerStats st = sched.stats();
    std::string o;
    const auto line = [&](const std::string& s) { o += s + "\n"; };
    const auto fmt = [](double v) {
      char b[64];
      std::snprintf(b, sizeof b, "%.9g", v);
      return std::string(b);
    };
    line("# HELP fp8moe_requests_total HTTP requests by endpoint and status.");
    line("# TYPE fp8moe_requests_total counter");
    double rate = 0;
    {
      std::lock_guard<std::mutex> l(stats_mu);
      for (const auto& [k, v] : requests)
        line("fp8moe_requests_total{endpoint=\"" + k.first + "\",status=\"" + std::to_string(k.second) + "\"} " +
             std::to_string(v));
      if (token_history.size() >= 2) {
        const double dt = std::chrono::duration<double>(token_history.back().first - token_history.front().first).count();
        if (dt > 0) rate = double(token_history.back().second - token_history.front().second) / dt;
      }
    }
    line("# HELP fp8moe_requests_finished_total Requests by how they ended.");
    line("# TYPE fp8moe_requests_finished_total counter");
    line("fp8moe_requests_finished_total{reason=\"completed\"} " + std::to_string(st.finished));
    line("fp8moe_requests_finished_total{reason=\"cancelled\"} " + std::to_string(st.cancelled));
    // One sample per metric: its help, type and value.
    const auto single = [&](const char* name, const char* type, const std::string& value, const char* help) {
      line(std::string("# HELP ") + name + " " + help);
      line(std::string("# TYPE ") + name + " " + type);
      line(std::string(name) + " " + value);
    };
    single("fp8moe_prompt_tokens_total", "counter", std::to_string(st.prompt_tokens), "Prompt tokens accepted.");
    single("fp8moe_generation_tokens_total", "counter", std::to_string(st.generated_tokens), "Tokens generated.");
    single("fp8moe_generation_tokens_per_second", "gauge", fmt(rate), "Generated tokens per second over the last 10 s.");
    for (const auto& [name, v] : {std::pair{"fp8moe_time_to_first_token_seconds", &st.ttft},
                                  std::pair{"fp8moe_inter_token_latency_seconds", &st.itl}}) {
      line(std::string("# HELP ") + name + " Over the latest 10000 samples.");
      line(std::string("# TYPE ") + name + " summary");
      for (double q : {0.5, 0.9, 0.99}) line(std::string(name) + "{quantile=\"" + fmt(q) + "\"} " + fmt(quantile(*v, q)));
      double sum = 0;
      for (double x : *v) sum += x;
      line(std::string(name) + "_sum " + fmt(sum));
      line(std::string(name) + "_count " + std::to_string(v->size()));
    }
    single("fp8moe_queue_length", "gauge", std::to_string(st.waiting),
           "Requests waiting for admission (preempted ones included).");
    single("fp8moe_running_requests", "gauge", std::to_string(st.running), "Requests in the running batch.");
    single("fp8moe_cache_blocks_in_use", "gauge", std::to_string(st.blocks_used), "Latent cache blocks held by requests.");
    single("fp8moe_cache_blocks_total", "gauge", std::to_string(st.blocks_total), "Latent cache blocks of 64 tokens.");
    single("fp8moe_preemptions_total", "counter", std::to_string(st.preemptions), "Requests preempted for cache blocks.");
    return o;
  }

  void engine_loop() {
    while (!stopping) {
      bool worked = false;
      try {
        worked = sched.step();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "fp8moe serve: engine step failed: %s\n", e.what());
      }
      {
        std::lock_guard<std::mutex> l(stats_mu);
        const auto now = Clock::now();
        token_history.emplace_back(now, sched.stats().generated_tokens);
        while (token_history.size() > 2 && now - token_history.front().first > std::chrono::seconds(10))
          token_history.pop_front();
      }
      if (!worked) {
        std::unique_lock<std::mutex> l(wake_mu);
        wake_cv.wait_for(l, std::chrono::milliseconds(5));
      }
    }
  }

  void routes() {
    http.new_task_queue = [n = opt.http_threads] { return new httplib::ThreadPool(size_t(n)); };
    http.Post("/v1/completions", [this](const httplib::Request& q, httplib::Response& r) { completion(q, r, false); });
    http.Post("/v1/chat/completions", [this](const httplib::Request& q, httplib::Response& r) { completion(q, r, true); });
    http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& r) {
      json m = {{"id", opt.model}, {"object", "model"}, {"created", created}, {"owned_by", "fp8moe"},
                {"max_model_len", engine.config().max_position_embeddings}};
      r.set_content(dump(json{{"object", "list"}, {"data", json::array({m})}}), "application/json");
      count("/v1/models", 200);
    });
    http.Get("/health", [this](const httplib::Request&, httplib::Response& r) {
      r.set_content(R"({"status":"ok"})", "application/json");
      count("/health", 200);
    });
    http.Get("/metrics", [this](const httplib::Request&, httplib::Response& r) {
      r.set_content(metrics(), "text/plain; version=0.0.4");
    });
    http.set_error_handler([](const httplib::Request& q, httplib::Response& r) {
      if (!r.body.empty()) return;  // a handler's own error body
      const HttpError e{r.status, "no route " + q.method + " " + q.path, "invalid_request_error", "", ""};
      r.set_content(error_body(e), "application/json");
    });
  }
};

Server::Server(Engine& engine, const ServerOptions& opt) : impl_(std::make_unique<Impl>(engine, opt)) {}
Server::Server(Engine& engine, Batcher& batcher, const ServerOptions& opt)
    : impl_(std::make_unique<Impl>(engine, batcher, opt)) {}
Server::~Server() = default;

void Server::run(const std::function<void(int)>& on_listening) {
  Impl& m = *impl_;
  // NOTES: a write to a socket whose client went away raises SIGPIPE, which would end the
  // process; ignored, the write fails and the stream's request is cancelled.
  std::signal(SIGPIPE, SIG_IGN);
  m.routes();
  const int port = m.opt.port == 0 ? m.http.bind_to_any_port(m.opt.host) : (m.http.bind_to_port(m.opt.host, m.opt.port) ? m.opt.port : -1);
  FP8MOE_CHECK(port > 0, "serve: cannot bind " << m.opt.host << ":" << m.opt.port);
  std::thread engine_thread([&m] { m.engine_loop(); });
  if (on_listening) on_listening(port);
  m.http.listen_after_bind();
  m.stopping = true;
  m.wake_cv.notify_all();
  engine_thread.join();
}

void Server::stop() {
  Impl& m = *impl_;
  m.stopping = true;
  m.wake_cv.notify_all();
  // In-flight requests end as cancelled first, so that the HTTP threads waiting on them return
  // and the server's thread pool can be joined.
  std::map<uint64_t, std::shared_ptr<Channel>> live;
  {
    std::lock_guard<std::mutex> l(m.live_mu);
    live = m.live;
  }
  for (auto& [id, ch] : live) {
    std::lock_guard<std::mutex> l(ch->mu);
    ch->done = true;
    ch->reason = "cancelled";
    ch->cv.notify_all();
  }
  m.http.stop();
}

}  // namespace fp8moe::serve
