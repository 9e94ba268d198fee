// The desktop HTTP calls (pull-lease, extend, cancel, result) with the retry rules of docs/desktop-protocol.md:
// a lost connection, 429 and 503 are retried (after Retry-After when given, else with backoff); 400, 404 and 409
// are answers, never retried.

import { Agent as HttpAgent, request as httpRequest, type IncomingHttpHeaders } from 'node:http';
import { Agent as HttpsAgent, request as httpsRequest } from 'node:https';

import type {
  CancelRequest, CancelResponse, ErrorBody, ExtendRequest, ExtendResponse, LeaseRequest, LeaseResponse, ResultRequest,
  ResultResponse,
} from './generated/protocol.js';
import { backoffDelay, type BackoffOptions } from './rules.js';

export class HubHttpError extends Error {
  constructor(readonly status: number, readonly body: ErrorBody) {
    super(`${status} ${body.error}: ${body.message}`);
    this.name = 'HubHttpError';
  }

  /** The lease is no longer this client's (another epoch holds it, or the task ended): stop the task, no
   * further calls with its token. */
  get fenced(): boolean {
    return this.status === 404 || (this.status === 409 && this.body.error === 'stale_lease');
  }
}

export interface HttpOptions {
  baseUrl: string;
  token: string;
  backoff: BackoffOptions;
  /** Attempts for one call when the hub cannot be reached or answers 429/503. */
  attempts: number;
  random?: () => number;
}

const RETRIED = new Set([429, 503]);

interface RawResponse {
  status: number;
  headers: IncomingHttpHeaders;
  text: string;
}

/** node:http with a keep-alive agent of its own (closed by `close()`), not the global fetch, whose pooled sockets
 * outlive a stopped client until the server's keep-alive timeout. */
export class HubHttp {
  private readonly agent: HttpAgent;
  private readonly secure: boolean;

  constructor(private readonly options: HttpOptions) {
    this.secure = new URL(options.baseUrl).protocol === 'https:';
    this.agent = this.secure ? new HttpsAgent({ keepAlive: true }) : new HttpAgent({ keepAlive: true });
  }

  /** Close the pooled connections. */
  close(): void {
    this.agent.destroy();
  }

  lease(body: LeaseRequest): Promise<LeaseResponse> {
    return this.post<LeaseResponse>('/api/desktop/monitor/lease', body);
  }

  extend(taskId: string, body: ExtendRequest, traceparent?: string): Promise<ExtendResponse> {
    return this.post<ExtendResponse>(`/api/desktop/tasks/${taskId}/extend`, body, traceparent);
  }

  cancel(taskId: string, body: CancelRequest, traceparent?: string): Promise<CancelResponse> {
    return this.post<CancelResponse>(`/api/desktop/tasks/${taskId}/cancel`, body, traceparent);
  }

  /** 202 only once the broker confirmed it; the same body again is answered the same (safe to retry). */
  result(taskId: string, body: ResultRequest, traceparent?: string, attempts = 8): Promise<ResultResponse> {
    return this.post<ResultResponse>(`/api/desktop/tasks/${taskId}/result`, body, traceparent, attempts);
  }

  async post<T>(path: string, body: unknown, traceparent?: string, attempts = this.options.attempts): Promise<T> {
    const headers: Record<string, string> = {
      Authorization: `Bearer ${this.options.token}`, 'Content-Type': 'application/json',
    };
    if (traceparent) headers.traceparent = traceparent;
    let lastError: unknown;
    for (let attempt = 0; attempt < attempts; attempt += 1) {
      let response: RawResponse;
      try {
        response = await this.send(new URL(path, this.options.baseUrl), headers, JSON.stringify(body));
      } catch (error) {  // the hub could not be reached (or dropped the call): try again
        lastError = error;
        await sleep(backoffDelay(attempt, this.options.backoff, this.options.random));
        continue;
      }
      const parsed: unknown = response.text ? JSON.parse(response.text) : {};
      if (response.status >= 200 && response.status < 300) return parsed as T;
      const error = new HubHttpError(response.status, parsed as ErrorBody);
      if (!RETRIED.has(response.status)) throw error;
      lastError = error;
      const retryAfter = Number(response.headers['retry-after']);
      await sleep(Number.isFinite(retryAfter) && retryAfter > 0 ? retryAfter * 1000
        : backoffDelay(attempt, this.options.backoff, this.options.random));
    }
    throw lastError;
  }

  private send(url: URL, headers: Record<string, string>, body: string): Promise<RawResponse> {
    const request = this.secure ? httpsRequest : httpRequest;
    return new Promise((resolve, reject) => {
      const call = request(url, { method: 'POST', agent: this.agent, timeout: 30_000,
                                  headers: { ...headers, 'Content-Length': Buffer.byteLength(body) } }, (response) => {
        const chunks: Buffer[] = [];
        response.on('data', (chunk: Buffer) => chunks.push(chunk));
        response.on('end', () => resolve({ status: response.statusCode ?? 0, headers: response.headers,
                                           text: Buffer.concat(chunks).toString('utf8') }));
        response.on('error', reject);
      });
      call.on('timeout', () => call.destroy(new Error('the hub did not answer within 30 s')));
      call.on('error', reject);
      call.end(body);
    });
  }
}

export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    if (signal?.aborted) return resolve();
    const timer = setTimeout(done, ms);
    function done(): void {
      clearTimeout(timer);
      signal?.removeEventListener('abort', done);
      resolve();
    }
    signal?.addEventListener('abort', done, { once: true });
  });
}
