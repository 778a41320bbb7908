/*
 * The CPU floor of a relay that forwards each message as it arrives, on this machine.
 *
 * Three processes, all on loopback or a socketpair made here: a "client" sends a request
 * over TCP (TCP_NODELAY) and reads five messages back; the "relay" (this process) forwards
 * the request to a "kernel" over a unix socket and each of the kernel's five messages back
 * to the client, one epoll wake-up per message and no other work at all; the "kernel"
 * answers each request with five 400-byte messages, GAP_US apart (ipykernel's `1+1` is six
 * messages through a gateway: the request, then busy, execute_input, execute_result,
 * execute_reply and idle, each at its own moment).
 *
 * It prints the relay's CPU time (user + system, getrusage) per round: what a gateway
 * doing nothing but forwarding pays in wake-ups and system calls. BENCHMARKS.md compares
 * cellgate's CPU per execute (scenario 2) with it.
 *
 *   cc -O2 -o /tmp/relay bench/floor/relay.c && /tmp/relay [ROUNDS=3000] [GAP_US=300]
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define MSG 400
#define PER_ROUND 5

static double cpu_seconds(void) {
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    return r.ru_utime.tv_sec + r.ru_utime.tv_usec / 1e6 + r.ru_stime.tv_sec +
           r.ru_stime.tv_usec / 1e6;
}

static void read_exactly(int fd, char *buf, int n) {
    for (int got = 0; got < n;) {
        int r = read(fd, buf + got, n - got);
        if (r <= 0) exit(2);
        got += r;
    }
}

static void write_all(int fd, const char *buf, int n) {
    for (int put = 0; put < n;) {
        int w = write(fd, buf + put, n - put);
        if (w <= 0) exit(3);
        put += w;
    }
}

int main(int argc, char **argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 3000;
    int gap_us = argc > 2 ? atoi(argv[2]) : 300;
    int one = 1;
    char msg[MSG];
    memset(msg, 'x', MSG);

    int kernel[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, kernel) != 0) return 1;
    int listener = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof addr;
    if (bind(listener, (void *)&addr, sizeof addr) || listen(listener, 1) ||
        getsockname(listener, (void *)&addr, &len))
        return 1;

    if (fork() == 0) { /* kernel */
        close(kernel[0]);
        for (int i = 0; i < rounds; i++) {
            read_exactly(kernel[1], msg, MSG);
            for (int j = 0; j < PER_ROUND; j++) {
                if (gap_us) usleep(gap_us);
                write_all(kernel[1], msg, MSG);
            }
        }
        exit(0);
    }
    if (fork() == 0) { /* client */
        char replies[MSG * PER_ROUND];
        int c = socket(AF_INET, SOCK_STREAM, 0);
        setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (connect(c, (void *)&addr, sizeof addr)) exit(1);
        for (int i = 0; i < rounds; i++) {
            write_all(c, msg, MSG);
            read_exactly(c, replies, sizeof replies);
        }
        exit(0);
    }

    close(kernel[1]);
    int client = accept(listener, NULL, NULL);
    setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int ep = epoll_create1(0);
    struct epoll_event from_client = {.events = EPOLLIN, .data.fd = client};
    struct epoll_event from_kernel = {.events = EPOLLIN, .data.fd = kernel[0]};
    epoll_ctl(ep, EPOLL_CTL_ADD, client, &from_client);
    epoll_ctl(ep, EPOLL_CTL_ADD, kernel[0], &from_kernel);

    static char buf[65536];
    long wakes = 0, forwarded = 0;
    double start = cpu_seconds();
    while (forwarded < (long)rounds * PER_ROUND * MSG) {
        struct epoll_event ready[4];
        int n = epoll_wait(ep, ready, 4, -1);
        wakes++;
        for (int i = 0; i < n; i++) {
            int fd = ready[i].data.fd;
            int r = read(fd, buf, sizeof buf);
            if (r <= 0) exit(4);
            if (fd == client) {
                write_all(kernel[0], buf, r);
            } else {
                write_all(client, buf, r);
                forwarded += r;
            }
        }
    }
    double used = cpu_seconds() - start;
    printf("relay CPU per round: %.1f us (%.2f wake-ups per round, %d us between messages)\n",
           used / rounds * 1e6, (double)wakes / rounds, gap_us);
    wait(NULL);
    wait(NULL);
    return 0;
}
