/* replay.c - run fuzz_core.c's LLVMFuzzerTestOneInput once on each file named
 * on the command line, without libFuzzer. tests/test_fuzz_corpus.py builds it
 * with any C compiler and replays fuzz/corpus/ (the seeds and every crash
 * the fuzzer ever found) as part of `make test`. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        FILE *f = fopen(argv[i], "rb");
        if (f == NULL) {
            perror(argv[i]);
            return 2;
        }
        static uint8_t buf[1 << 20];
        size_t n = fread(buf, 1, sizeof buf, f);
        fclose(f);
        LLVMFuzzerTestOneInput(buf, n);
    }
    printf("replayed %d inputs\n", argc - 1);
    return 0;
}
