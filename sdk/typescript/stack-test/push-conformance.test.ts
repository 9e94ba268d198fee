// Outside test/ on purpose: `npm test` (and tests/e2e/test_typescript_sdk.py, whose stack has push-lease off) run
// test/; this file needs a stack with push-lease on.
// Push-lease against the real stack (tests/e2e/test_typescript_sdk_push.py boots it with push-lease on and sets the
// environment): the client asks for push_lease, is granted it, and a click's tasks arrive leased on task_available;
// it runs them and posts their results without a single lease call.
import assert from 'node:assert/strict';
import { once } from 'node:events';
import { test } from 'node:test';

import { DesktopClient, HubHttp, PHASES, PUSH_LEASE, sleep, type LeasedTask, type TaskContext,
         type TaskOutcome } from '../src/index.js';

const env = process.env;
const stack = env.MONITOR_PUSH_HUB_URL ? {
  hubUrl: env.MONITOR_PUSH_HUB_URL, apiUrl: env.MONITOR_API_URL!, token: env.MONITOR_CLIENT_TOKEN!,
  clientId: env.MONITOR_CLIENT_ID!, jwt: env.MONITOR_JWT!, brandId: env.MONITOR_BRAND_ID!,
} : null;
const skip = stack ? false : 'needs the stack with push-lease on: run tests/e2e/test_typescript_sdk_push.py';

async function automate(context: TaskContext): Promise<TaskOutcome> {
  for (const next of PHASES.slice(1)) {
    await sleep(10, context.signal);
    if (!(await context.checkpoint(next))) return { status: 'failed', error: 'stopped' };
    if (next === 'POSTING') break;
  }
  return { status: 'succeeded', answer_text: `${context.task.brand.name} is mentioned`, brand_mentioned: true };
}

async function until(check: () => boolean, what: string, timeoutMs = 20_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!check()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await sleep(20);
  }
}

test('a click\'s tasks arrive leased and run without a lease call', { skip, timeout: 40_000 }, async () => {
  const s = stack!;
  const client = new DesktopClient({ hubUrl: s.hubUrl, token: s.token, execute: automate, maxConcurrent: 4,
                                     idlePollMs: 500, backoff: { baseMs: 100, maxMs: 2000 } });
  let leaseCalls = 0;
  const lease = client.http.lease.bind(client.http);
  client.http.lease = (body) => { leaseCalls += 1; return lease(body); };
  const results: LeasedTask[] = [];
  const failures: unknown[] = [];
  client.on('result', (task) => results.push(task));
  client.on('failure', (error) => failures.push(error));
  const hello = once(client, 'hello');
  client.start();
  try {
    const [greeting] = await hello;
    assert.deepEqual(greeting.capabilities, [PUSH_LEASE]);
    const api = new HubHttp({ baseUrl: s.apiUrl, token: s.jwt, backoff: { baseMs: 100, maxMs: 1000 }, attempts: 3 });
    const accepted = await api.post<{ promoted_task_count: number }>(
      `/api/tenant/monitoring/brands/${s.brandId}/collect-now`, { target_client_id: s.clientId });
    api.close();
    assert.ok(accepted.promoted_task_count > 0);
    await until(() => results.length >= accepted.promoted_task_count, 'the pushed tasks\' results');
    assert.equal(client.pushedLeases, accepted.promoted_task_count);
    assert.equal(leaseCalls, 0, 'a push client calls lease only for work the hub said is queued');
    for (const task of results) assert.equal(task.lease_epoch, 1);
    assert.deepEqual(failures, []);
  } finally {
    await client.stop();
  }
});
