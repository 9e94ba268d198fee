import assert from 'node:assert/strict';
import { test } from 'node:test';

import { pushedLease, type TaskAvailable } from '../src/index.js';

const queued: TaskAvailable = {
  type: 'task_available', kind: 'monitor', task_id: '6c1f1f2e-0000-4000-8000-000000000001',
  target_client_id: '6c1f1f2e-0000-4000-8000-000000000002', priority: 10, lane: 'high', business_date: '2026-12-02',
  interrupt_generation: 3, updated_at: '2026-12-02T06:00:00Z', monitor_task_id: 42,
};

test('a task_available without a lease is leased by pull', () => {
  assert.equal(pushedLease(queued), null);
  // A token without what the task runs is not a lease either (a hub bug must not start an empty task).
  assert.equal(pushedLease({ ...queued, lease_token: 'lt1.1.x', lease_epoch: 1 }), null);
});

test('a pushed task_available is the lease a lease call would have answered', () => {
  const lease = pushedLease({
    ...queued, lease_token: 'lt1.1.abc', lease_epoch: 1, lease_expires_at: '2026-12-02T06:00:30Z',
    brand: { brand_id: 7, name: 'Acme' }, question: { question_id: 9, text: 'best?' },
    platform: { ai_platform_id: 2, code: 'openai', mode: 'quick' },
  });
  assert.deepEqual(lease, {
    task_id: queued.task_id, monitor_task_id: 42, lane: 'high', priority: 10, lease_token: 'lt1.1.abc',
    lease_expires_at: '2026-12-02T06:00:30Z', lease_epoch: 1, interrupt_generation: 3, business_date: '2026-12-02',
    brand: { brand_id: 7, name: 'Acme' }, question: { question_id: 9, text: 'best?' },
    platform: { ai_platform_id: 2, code: 'openai', mode: 'quick' }, interrupt_requested: false,
    execution_owner: 'desktop_tasks',
  });
});
