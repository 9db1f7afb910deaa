// LD_PRELOAD: live sum of allocations >= 1 MB; shim_arm() resets the max; at each new max the table is snapshot;
// shim_peak_dump(path) writes the snapshot (size, seq, backtrace). Diagnostic only.
#define _GNU_SOURCE
#include <execinfo.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
extern void *__libc_malloc(size_t); extern void __libc_free(void *); extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t); extern void *__libc_memalign(size_t, size_t);
#define BIG (1u << 20)
#define N 8192
typedef struct { void *p; size_t size; long seq; int depth; void *bt[16]; } Entry;
static Entry table[N], snap[N]; static long seq; static size_t live, maxlive; static long snapseq;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER; static __thread int busy;
static void track(void *p, size_t size) {
  if (!p || size < BIG || busy) return;
  busy = 1; void *bt[16]; int d = backtrace(bt, 16); busy = 0;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < N; i++) if (!table[i].p) { table[i].p = p; table[i].size = size;
      table[i].seq = seq++; table[i].depth = d; memcpy(table[i].bt, bt, sizeof bt); live += size; break; }
  if (live > maxlive) { maxlive = live; snapseq = seq; memcpy(snap, table, sizeof table); }
  pthread_mutex_unlock(&mu);
}
static void untrack(void *p) {
  if (!p) return; pthread_mutex_lock(&mu);
  for (int i = 0; i < N; i++) if (table[i].p == p) { table[i].p = 0; live -= table[i].size; break; }
  pthread_mutex_unlock(&mu);
}
void *malloc(size_t s) { void *p = __libc_malloc(s); track(p, s); return p; }
void *calloc(size_t n, size_t s) { void *p = __libc_calloc(n, s); track(p, n * s); return p; }
void *realloc(void *o, size_t s) { untrack(o); void *p = __libc_realloc(o, s); track(p, s); return p; }
int posix_memalign(void **r, size_t a, size_t s) { void *p = __libc_memalign(a, s); if (!p) return 12; *r = p; track(p, s); return 0; }
void *aligned_alloc(size_t a, size_t s) { void *p = __libc_memalign(a, s); track(p, s); return p; }
void *memalign(size_t a, size_t s) { void *p = __libc_memalign(a, s); track(p, s); return p; }
void free(void *p) { untrack(p); __libc_free(p); }
void shim_arm(void) { pthread_mutex_lock(&mu); maxlive = live; snapseq = seq; memcpy(snap, table, sizeof table); pthread_mutex_unlock(&mu); }
long shim_live(void) { return (long)live; }  // bytes in live blocks >= 1 MB
void shim_peak_dump(const char *path) {
  FILE *f = fopen(path, "w"); if (!f) return; busy = 1;
  pthread_mutex_lock(&mu);
  fprintf(f, "PEAK live=%zu at seq=%ld now=%zu\n", maxlive, snapseq, live);
  for (int i = 0; i < N; i++) if (snap[i].p) {
    fprintf(f, "LIVE seq=%ld size=%zu\n", snap[i].seq, snap[i].size); fflush(f);
    backtrace_symbols_fd(snap[i].bt, snap[i].depth, fileno(f)); }
  pthread_mutex_unlock(&mu); busy = 0; fclose(f);
}
