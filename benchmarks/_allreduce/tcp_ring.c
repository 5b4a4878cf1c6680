/* The loopback TCP ceiling for a ring allreduce: every rank streams 2(n-1)/n * size bytes to its right
 * neighbour while receiving as many from its left, concurrently and with no reduction, which is the least
 * traffic a bandwidth-optimal allreduce must move. "oneway" mode (n = 2) streams size bytes from rank 0 to
 * rank 1, the single-connection figure for reference.
 *
 * One thread per rank drives both sockets with poll(), as an event loop would. When neither socket is ready it
 * spins (poll with no wait, then sched_yield) for up to SPIN_US before sleeping in poll: on loopback, sleeping
 * and waking on every drained socket buffer costs more than the copies (measured on 2 cores: 4 KiB latency 8x
 * lower, 1 to 16 MiB about 1.5x faster), and yielding keeps the spin harmless when ranks outnumber cores.
 * OpenMPI's progress loop and our engine spin as well, so a ceiling that slept would be one they beat.
 * Between iterations a two-round token barrier circles the ring on the same connections; rank 0's token
 * carries the agreed iteration count.
 *
 * usage: tcp_ring ring|oneway RANK NP PORT,PORT,... SIZE,SIZE,... WARMUP MAX_ITERS MIN_ITERS SECONDS OUT
 * Writes {"<series>": {"<size>": [seconds, ...], ...}} to OUT. Every wait is bounded; failures exit nonzero. */
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define DEADLINE_MS 60000
#define SPIN_US 200
/* Page-aligned buffers and 64-byte tokens keep every transfer in line with the byte stream: the kernel's
 * copies between user memory and socket buffers run up to 2x slower on AMD EPYC when the two sides sit a
 * few bytes apart within a page (docs/engine.md, Frames), and a ceiling must not fall into that. */
#define TOKEN_BYTES 64

static void die(const char *what) {
  fprintf(stderr, "tcp_ring: %s: %s\n", what, errno ? strerror(errno) : "failed");
  exit(1);
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int parse_list(const char *s, long *out, int max) {
  int n = 0;
  for (char *end; *s && n < max; s = *end ? end + 1 : end) out[n++] = strtol(s, &end, 10);
  return n;
}

static void nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static struct sockaddr_in loopback(long port) {
  struct sockaddr_in a = {0};
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return a;
}

/* Moves send_n bytes out of right and recv_n bytes in from left, concurrently. */
static void transfer(int right, const char *sbuf, long send_n, int left, char *rbuf, long recv_n) {
  long sent = 0, got = 0;
  double idle_since = 0; /* when this wait began spinning; 0 while progressing */
  while (sent < send_n || got < recv_n) {
    struct pollfd q[2];
    int nfds = 0;
    if (sent < send_n) q[nfds++] = (struct pollfd){right, POLLOUT, 0};
    if (got < recv_n) q[nfds++] = (struct pollfd){left, POLLIN, 0};
    int r = poll(q, nfds, 0);
    if (r == 0) {
      if (idle_since == 0) idle_since = now();
      if (now() - idle_since < SPIN_US * 1e-6) {
        sched_yield();
        continue;
      }
      r = poll(q, nfds, DEADLINE_MS);
      if (r == 0) { errno = ETIMEDOUT; die("waiting for a neighbour"); }
    }
    idle_since = 0;
    if (r < 0 && errno != EINTR) die("poll");
    for (int i = 0; i < nfds; i++) {
      if (q[i].fd == right && (q[i].revents & (POLLOUT | POLLERR | POLLHUP)) && sent < send_n) {
        ssize_t k = send(right, sbuf + sent, send_n - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k < 0 && errno != EAGAIN && errno != EINTR) die("send to right neighbour");
        if (k > 0) sent += k;
      } else if (q[i].fd == left && (q[i].revents & (POLLIN | POLLERR | POLLHUP)) && got < recv_n) {
        ssize_t k = recv(left, rbuf + got, recv_n - got, MSG_DONTWAIT);
        if (k == 0) { errno = ECONNRESET; die("left neighbour closed"); }
        if (k < 0 && errno != EAGAIN && errno != EINTR) die("recv from left neighbour");
        if (k > 0) got += k;
      }
    }
  }
}

/* Two token rounds around the ring: after the first every rank has arrived, the second releases them.
 * Returns rank 0's payload. */
static int64_t barrier(int rank, int right, int left, int64_t payload) {
  _Alignas(64) char tok[TOKEN_BYTES] = {0};
  memcpy(tok, &payload, sizeof payload);
  for (int round = 0; round < 2; round++) {
    if (rank == 0) {
      transfer(right, tok, sizeof tok, left, NULL, 0);
      transfer(right, NULL, 0, left, tok, sizeof tok);
    } else {
      transfer(right, NULL, 0, left, tok, sizeof tok);
      transfer(right, tok, sizeof tok, left, NULL, 0);
    }
  }
  memcpy(&payload, tok, sizeof payload);
  return payload;
}

static void connect_ring(int rank, int np, const long *ports, int *right, int *left) {
  int ls = socket(AF_INET, SOCK_STREAM, 0), one = 1;
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in me = loopback(ports[rank]);
  if (bind(ls, (struct sockaddr *)&me, sizeof me) || listen(ls, 4)) die("listen");
  struct sockaddr_in peer = loopback(ports[(rank + 1) % np]);
  double give_up = now() + DEADLINE_MS / 1000.0;
  for (;;) {
    *right = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(*right, (struct sockaddr *)&peer, sizeof peer) == 0) break;
    close(*right);
    if (now() > give_up) die("connecting to the right neighbour");
    usleep(20000);
  }
  struct pollfd p = {ls, POLLIN, 0};
  if (poll(&p, 1, DEADLINE_MS) != 1) { errno = ETIMEDOUT; die("waiting for the left neighbour"); }
  *left = accept(ls, NULL, NULL);
  if (*left < 0) die("accept");
  close(ls);
  nodelay(*right);
  nodelay(*left);
}

int main(int argc, char **argv) {
  if (argc != 11) { fprintf(stderr, "usage: see tcp_ring.c\n"); return 2; }
  int oneway = strcmp(argv[1], "oneway") == 0, rank = atoi(argv[2]), np = atoi(argv[3]);
  long ports[64], sizes[64];
  if (parse_list(argv[4], ports, 64) != np) { fprintf(stderr, "tcp_ring: need one port per rank\n"); return 2; }
  int nsizes = parse_list(argv[5], sizes, 64);
  int warmup = atoi(argv[6]), max_iters = atoi(argv[7]), min_iters = atoi(argv[8]);
  double seconds = atof(argv[9]);
  char tmp_path[4096];
  snprintf(tmp_path, sizeof tmp_path, "%s.tmp", argv[10]);
  FILE *out = fopen(tmp_path, "w"); /* renamed when complete: the driver never reads a partial file */
  if (!out) die("opening the output file");

  int right, left;
  connect_ring(rank, np, ports, &right, &left);
  long biggest = 0;
  for (int s = 0; s < nsizes; s++) biggest = sizes[s] > biggest ? sizes[s] : biggest;
  long alloc = (biggest * 2 + 4095) / 4096 * 4096;
  char *sbuf = aligned_alloc(4096, alloc), *rbuf = aligned_alloc(4096, alloc);
  if (!sbuf || !rbuf) die("aligned_alloc");
  memset(sbuf, 1, alloc);
  memset(rbuf, 0, alloc);

  fprintf(out, "{\"%s\": {", oneway ? "raw TCP one-way" : "raw TCP ring");
  for (int s = 0; s < nsizes; s++) {
    long ring_n = sizes[s] * 2 * (np - 1) / np;
    long send_n = oneway ? (rank == 0 ? sizes[s] : 0) : ring_n;
    long recv_n = oneway ? (rank == 1 ? sizes[s] : 0) : ring_n;
    double t = 0;
    for (int i = 0; i < warmup; i++) {
      barrier(rank, right, left, 0);
      double t0 = now();
      transfer(right, sbuf, send_n, left, rbuf, recv_n);
      t = now() - t0;
    }
    long want = (long)(seconds / (t > 1e-7 ? t : 1e-7));
    want = want > max_iters ? max_iters : (want < min_iters ? min_iters : want);
    int iters = (int)barrier(rank, right, left, want);
    fprintf(out, "%s\"%ld\": [", s ? ", " : "", sizes[s]);
    for (int i = 0; i < iters; i++) {
      barrier(rank, right, left, 0);
      double t0 = now();
      transfer(right, sbuf, send_n, left, rbuf, recv_n);
      fprintf(out, "%s%.9f", i ? ", " : "", now() - t0);
    }
    fprintf(out, "]");
  }
  fprintf(out, "}}\n");
  barrier(rank, right, left, 0); /* nobody closes a socket a neighbour still reads */
  if (fclose(out) || rename(tmp_path, argv[10])) die("writing the output file");
  return 0;
}
