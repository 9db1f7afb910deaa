// LD_PRELOAD diagnostic (bench/real_size.py REAL_SIZE_ALLOC_DUMP): remembers every live allocation >= 16 MB with a
// backtrace; shim_dump(path) writes them. Build: gcc -O1 -shared -fPIC -o alloc_trace.so alloc_trace.c -lpthread
#define _GNU_SOURCE
#include <execinfo.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
extern void *__libc_malloc(size_t); extern void __libc_free(void *); extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t); extern void *__libc_memalign(size_t, size_t);
#define BIG (16u << 20)
#define N 512
typedef struct { void *p; size_t size; int kind; long seq; int depth; void *bt[24]; } Entry;
static Entry table[N]; static long seq; static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static __thread int busy;
static void track(void *p, size_t size, int kind) {
  if (!p || size < BIG || busy) return;
  busy = 1; void *bt[24]; int d = backtrace(bt, 24); busy = 0;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < N; i++) if (!table[i].p) { table[i].p = p; table[i].size = size; table[i].kind = kind;
      table[i].seq = seq++; table[i].depth = d; memcpy(table[i].bt, bt, sizeof bt); break; }
  pthread_mutex_unlock(&mu);
}
static void untrack(void *p) {
  if (!p) return; pthread_mutex_lock(&mu);
  for (int i = 0; i < N; i++) if (table[i].p == p) { table[i].p = 0; break; }
  pthread_mutex_unlock(&mu);
}
void *malloc(size_t s) { void *p = __libc_malloc(s); track(p, s, 0); return p; }
void *calloc(size_t n, size_t s) { void *p = __libc_calloc(n, s); track(p, n * s, 1); return p; }
void *realloc(void *o, size_t s) { untrack(o); void *p = __libc_realloc(o, s); track(p, s, 2); return p; }
int posix_memalign(void **r, size_t a, size_t s) { void *p = __libc_memalign(a, s); if (!p) return 12; *r = p; track(p, s, 3); return 0; }
void *aligned_alloc(size_t a, size_t s) { void *p = __libc_memalign(a, s); track(p, s, 4); return p; }
void *memalign(size_t a, size_t s) { void *p = __libc_memalign(a, s); track(p, s, 5); return p; }
void free(void *p) { untrack(p); __libc_free(p); }
long shim_mark(void) { return seq; }
void shim_dump(const char *path) {
  FILE *f = fopen(path, "w"); if (!f) return; busy = 1;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < N; i++) if (table[i].p) {
    fprintf(f, "LIVE seq=%ld size=%zu kind=%d\n", table[i].seq, table[i].size, table[i].kind); fflush(f);
    backtrace_symbols_fd(table[i].bt, table[i].depth, fileno(f)); }
  pthread_mutex_unlock(&mu); busy = 0; fclose(f);
}
