// The OpenAI-compatible HTTP server (cpp-httplib) in front of the continuous-batching scheduler
// (or of a Batcher such as a disaggregated deployment's front, disaggregated_front.hpp):
//   POST /v1/completions        {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k",
//                                "seed", "stop", "stream"}
//   POST /v1/chat/completions   {"model", "messages": [{"role", "content"}], ... as above}
//   GET  /v1/models, /health, /metrics (Prometheus text)
// Streaming answers are server-sent events ("data: {chunk}\n\n" ... "data: [DONE]\n\n"). Errors
// are OpenAI's body {"error": {"message", "type", "param", "code"}} with a 4xx status; a client
// that goes away mid-stream has its request cancelled (blocks freed). One engine thread steps the
// batcher; HTTP requests are served by a pool of threads that only submit and wait.
// Chat messages are joined as "<role>: <content>\n" lines followed by "assistant: " (the byte
// vocabulary has no chat template).
#pragma once
#include <atomic>
#include <memory>
#include <string>

#include "serve/engine.hpp"
#include "serve/scheduler.hpp"

namespace fp8moe::serve {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;             // 0: any free port (printed)
  std::string model = "fp8moe";  // the id clients name in "model"
  int http_threads = 64;       // concurrent connections served
  SchedulerOptions scheduler;
};

class Server {
 public:
  Server(Engine& engine, const ServerOptions& opt);  // its own Scheduler over the engine
  // Requests through `batcher` (a disaggregated deployment's front); the engine gives the config.
  Server(Engine& engine, Batcher& batcher, const ServerOptions& opt);
  ~Server();
  // Binds, reports the port through on_listening, serves until stop(); in-flight requests are
  // cancelled at the end.
  void run(const std::function<void(int port)>& on_listening = {});
  void stop();  // from any thread

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The prompt of a chat request (messages joined as above).
std::string chat_prompt(const std::vector<std::pair<std::string, std::string>>& messages);
// The longest prefix of s that ends on a whole UTF-8 character (so a streamed piece never splits
// one); invalid bytes count as whole characters.
size_t utf8_whole_prefix(std::string_view s);

}  // namespace fp8moe::serve
