import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'node:test';

// The SDK's types are generated from the committed AsyncAPI document; this fails when either changed alone.
test('src/generated/protocol.ts is what the committed AsyncAPI document generates', async () => {
  const root = join(import.meta.dirname, '..', '..');
  const { generate, OUTPUT } = await import(join(root, 'scripts', 'generate-types.mjs'));
  const expected: string = await generate();
  assert.equal(readFileSync(OUTPUT as string, 'utf8'), expected,
               'run `npm run generate` in sdk/typescript and commit src/generated/protocol.ts');
});
