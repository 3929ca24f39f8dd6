// Greedy token ids from llama.cpp's own library, for bench/llamacpp_tokens.py.
//
// Built against a llama.cpp build tree (docs/llamacpp.md), not part of pagewarden:
//     g++ -O2 -std=c++17 bench/llamacpp_greedy.cpp -I SRC/include -I SRC/ggml/include \
//         -L BUILD/bin -lllama -lggml -lggml-base -Wl,-rpath,BUILD/bin -o llamacpp_greedy
//     llamacpp_greedy -m MODEL.gguf [-n 32] [-t 2] < prompts
//
// Reads one prompt per stdin line, either "text:<prompt>" (tokenized by llama.cpp's
// tokenizer, special tokens added the way the model's metadata says, e.g. BOS) or
// "ids:<id> <id> ..." (fed as they are). For each it clears the KV memory, decodes the
// prompt in one batch, then takes the argmax token (llama_sampler_init_greedy) n times,
// feeding each back; it does not stop at end-of-generation tokens, so every line gets
// exactly n ids. Prints "prompt: <ids>" and "gen: <ids>" per line. The decode loop
// follows llama.cpp's examples/simple/simple.cpp (MIT licence).
#include "llama.h"

#include <clocale>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

// tokens at consecutive positions from pos_0 in sequence 0; logits for the last only
static void batch_set_tokens(llama_batch_ext * batch, const llama_token * tokens, int32_t n, llama_pos pos_0) {
    llama_batch_ext_clear(batch);
    for (int32_t i = 0; i < n; ++i) {
        const int32_t   idx = llama_batch_ext_add_token(batch, 0, tokens[i]);
        const llama_pos pos = pos_0 + i;
        llama_batch_ext_set_pos(batch, idx, &pos);
    }
    llama_batch_ext_set_output_logits(batch, n - 1, true);
}

static std::vector<llama_token> tokenize(const llama_vocab * vocab, const std::string & text) {
    const int n = -llama_tokenize(vocab, text.c_str(), text.size(), NULL, 0, true, false);
    std::vector<llama_token> ids(n);
    if (llama_tokenize(vocab, text.c_str(), text.size(), ids.data(), ids.size(), true, false) < 0) {
        ids.clear();
    }
    return ids;
}

static void print_ids(const char * label, const std::vector<llama_token> & ids) {
    printf("%s:", label);
    for (llama_token t : ids) {
        printf(" %d", t);
    }
    printf("\n");
}

static void quiet_log(enum ggml_log_level, const char *, void *) {}

int main(int argc, char ** argv) {
    std::setlocale(LC_NUMERIC, "C");
    std::string model_path;
    int         n_predict = 32;
    int         n_threads = 2;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "-m") == 0) {
            model_path = argv[i + 1];
        } else if (strcmp(argv[i], "-n") == 0) {
            n_predict = atoi(argv[i + 1]);
        } else if (strcmp(argv[i], "-t") == 0) {
            n_threads = atoi(argv[i + 1]);
        }
    }
    if (model_path.empty() || n_predict < 1 || n_threads < 1) {
        fprintf(stderr, "usage: %s -m MODEL.gguf [-n N_PREDICT] [-t THREADS] < prompts\n", argv[0]);
        return 2;
    }
    llama_log_set(quiet_log, NULL);
    llama_backend_init();
    llama_model * model = llama_model_load_from_file(model_path.c_str(), llama_model_default_params());
    if (model == NULL) {
        fprintf(stderr, "error: unable to load %s\n", model_path.c_str());
        return 1;
    }
    const llama_vocab *  vocab      = llama_model_get_vocab(model);
    llama_context_params ctx_params = llama_context_default_params();
    ctx_params.n_ctx                = 2048;
    ctx_params.n_batch              = 2048;
    ctx_params.n_threads            = n_threads;
    ctx_params.n_threads_batch      = n_threads;
    llama_context * ctx             = llama_init_from_model(model, ctx_params);
    llama_sampler * smpl            = llama_sampler_chain_init(llama_sampler_chain_default_params());
    llama_sampler_chain_add(smpl, llama_sampler_init_greedy());
    llama_batch_ext * batch = llama_batch_ext_init(ctx);

    std::string line;
    while (std::getline(std::cin, line)) {
        std::vector<llama_token> prompt;
        if (line.rfind("text:", 0) == 0) {
            prompt = tokenize(vocab, line.substr(5));
        } else if (line.rfind("ids:", 0) == 0) {
            std::istringstream in(line.substr(4));
            for (llama_token t; in >> t;) {
                prompt.push_back(t);
            }
        }
        if (prompt.empty() || (int) prompt.size() + n_predict > ctx_params.n_ctx) {
            fprintf(stderr, "error: bad prompt line: %s\n", line.c_str());
            return 1;
        }
        llama_memory_clear(llama_get_memory(ctx), true);
        llama_sampler_reset(smpl);
        std::vector<llama_token> gen;
        batch_set_tokens(batch, prompt.data(), prompt.size(), 0);
        llama_pos pos = prompt.size();
        while ((int) gen.size() < n_predict) {
            if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch)) {
                fprintf(stderr, "error: decode failed\n");
                return 1;
            }
            const llama_token next = llama_sampler_sample(smpl, ctx, -1);
            gen.push_back(next);
            batch_set_tokens(batch, &next, 1, pos++);
        }
        print_ids("prompt", prompt);
        print_ids("gen", gen);
        fflush(stdout);
    }
    llama_batch_ext_free(batch);
    llama_sampler_free(smpl);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
