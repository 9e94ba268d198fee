// Conformance against the real stack (tests/e2e/test_typescript_sdk.py boots it and sets the environment): a
// client busy with scheduled work is preempted by a collect-now click, yields at a safe point, runs the high tasks
// and posts their results; a client offering only a newer major is refused without a reconnect loop.
import assert from 'node:assert/strict';
import { once } from 'node:events';
import { test } from 'node:test';

import {
  DesktopClient, HubHttp, PHASES, PROTOCOL_VERSION, SAFE_POINT_BEFORE, sleep, type ExecutionPhase, type LeasedTask,
  type TaskContext, type TaskOutcome,
} from '../src/index.js';

const env = process.env;
const stack = env.MONITOR_HUB_URL ? {
  hubUrl: env.MONITOR_HUB_URL, apiUrl: env.MONITOR_API_URL!, token: env.MONITOR_CLIENT_TOKEN!,
  clientId: env.MONITOR_CLIENT_ID!, jwt: env.MONITOR_JWT!, brandId: env.MONITOR_BRAND_ID!,
} : null;
const skip = stack ? false : 'needs the stack: run tests/e2e/test_typescript_sdk.py';

/** A browser automation stand-in: each phase takes `msPerPhase` (scheduled work slow enough to be caught running). */
async function automate(context: TaskContext): Promise<TaskOutcome> {
  const msPerPhase = context.task.lane === 'high' ? 20 : 400;
  for (const next of PHASES.slice(1)) {
    await sleep(msPerPhase, context.signal);
    if (!(await context.checkpoint(next))) return { status: 'failed', error: 'stopped' };
    if (next === 'POSTING') break;
  }
  return { status: 'succeeded', answer_text: `${context.task.brand.name} is mentioned`, brand_mentioned: true,
           citations: [{ url: 'https://example.com/a', title: 'A', position: 1 }] };
}

async function until(check: () => boolean, what: string, timeoutMs = 20_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!check()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await sleep(20);
  }
}

test('click -> preempt at a safe point -> yield -> high tasks -> results', { skip, timeout: 40_000 }, async () => {
  const s = stack!;
  const client = new DesktopClient({ hubUrl: s.hubUrl, token: s.token, execute: automate, idlePollMs: 1000,
                                     platformHealth: () => ({ openai: 'healthy' }), backoff: { baseMs: 100, maxMs: 2000 } });
  const leased: LeasedTask[] = [];
  const yielded: Array<{ task: LeasedTask; generation: number; phase: ExecutionPhase }> = [];
  const results: Array<{ task: LeasedTask; resultId: string | null }> = [];
  const interrupts: string[] = [];
  const failures: unknown[] = [];
  client.on('leased', (task) => leased.push(task));
  client.on('yielded', (task, generation, phase) => yielded.push({ task, generation, phase }));
  client.on('result', (task, _outcome, resultId) => results.push({ task, resultId }));
  client.on('taskControl', (event) => { if (event.control === 'interrupt_requested') interrupts.push(event.task_id); });
  client.on('failure', (error) => failures.push(error));
  const hello = once(client, 'hello');
  client.start();
  try {
    const [greeting, subprotocol] = await hello;
    assert.equal(subprotocol, 'monitor.desktop.v1');
    assert.equal(greeting.protocol_version, PROTOCOL_VERSION);
    assert.equal(greeting.client_id, s.clientId);

    // Scheduled work running past its "not really started" phases.
    await until(() => client.activeTasks.some((t) => t.lane !== 'high' &&
      ['AUTHENTICATING', 'INPUTTING', 'SUBMITTING'].includes(client.phaseOf(t.task_id) ?? '')), 'a running scheduled task');
    const running = client.activeTasks[0]!;

    // The user's click, through the tenant API (the gateway's JWT), with the SDK's HTTP helper.
    const api = new HubHttp({ baseUrl: s.apiUrl, token: s.jwt, backoff: { baseMs: 100, maxMs: 1000 }, attempts: 3 });
    const accepted = await api.post<{ interrupt_generation: number; promoted_task_count: number;
                                      interrupt_requested_count: number; idempotent_replay: boolean }>(
      `/api/tenant/monitoring/brands/${s.brandId}/collect-now`, { target_client_id: s.clientId, preempt: true });
    api.close();
    assert.equal(accepted.idempotent_replay, false);
    assert.equal(accepted.interrupt_requested_count, 1);

    await until(() => yielded.length > 0, 'the scheduled task to yield');
    const [yield_] = yielded;
    assert.equal(yield_!.task.task_id, running.task_id);
    assert.equal(yield_!.generation, accepted.interrupt_generation);
    const next = PHASES[PHASES.indexOf(yield_!.phase) + 1]!;
    assert.ok(SAFE_POINT_BEFORE.has(next), `yielded at the end of ${yield_!.phase}, before ${next}: not a safe point`);
    assert.ok(interrupts.includes(running.task_id), 'the interrupt came as a task_control on the socket');

    await until(() => results.filter((r) => r.task.lane === 'high').length >= accepted.promoted_task_count,
                'the high tasks\' results');
    const afterYield = leased.slice(leased.findIndex((t) => t.task_id === running.task_id) + 1);
    assert.deepEqual(afterYield.slice(0, accepted.promoted_task_count).map((t) => t.lane),
                     Array(accepted.promoted_task_count).fill('high'), 'high work goes first after the yield');
    for (const result of results.filter((r) => r.task.lane === 'high')) {
      assert.match(result.resultId ?? '', /^[0-9a-f-]{36}$/);
      assert.equal(result.task.lease_epoch, Number(result.task.lease_token.split('.')[1]));
    }
    assert.ok(!results.some((r) => r.task.task_id === running.task_id), 'no result for the yielded task');
    assert.deepEqual(failures, []);
  } finally {
    await client.stop();
  }
});

test('a client that offers only a newer major is refused once, not in a loop', { skip, timeout: 20_000 }, async () => {
  const s = stack!;
  const client = new DesktopClient({ hubUrl: s.hubUrl, token: s.token, protocolMajors: [2],
                                     execute: async () => ({ status: 'failed' }), idlePollMs: 0 });
  const refused = once(client, 'refused');
  client.start();
  try {
    const [refusal] = await refused;
    assert.equal(refusal.status, 400);
    assert.equal(refusal.reason, 'unsupported_protocol_version');
    assert.equal(refusal.body?.field, 'Sec-WebSocket-Protocol');
    await sleep(300);
    assert.equal(client.connects, 1);
  } finally {
    await client.stop();
  }
});
