-- Record rows of a batch, only from the holder of the fence key's token: -1 when the caller
-- no longer holds it. Each row is counted the first time it is recorded, and the job's hash
-- (KEYS[9], when given) keeps the latest time a row was counted (ARGV[5]).
-- KEYS: progress, stats, done, series rows, series tokens, node counters, fence, bstats[, job]
-- ARGV: batch, bucket, node, token, now, then (unit key, row, kind, tokens) per row.
local function bump(field, n)
  redis.call('HINCRBY', KEYS[2], field, n)
  redis.call('HINCRBY', KEYS[8], ARGV[1] .. '|' .. field, n)
end

if redis.call('GET', KEYS[7]) ~= ARGV[4] then return -1 end
local is_done = redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 1
local counted = 0
for i = 6, #ARGV, 4 do
  if redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) == 1 and not is_done then
    counted = counted + 1
    local kind = ARGV[i + 2]
    local tok = tonumber(ARGV[i + 3])
    if kind == 'failed' or kind == 'quarantined' then
      bump(kind, 1)
    else
      bump('completed', 1)
      if kind == 'truncated' then bump('truncated', 1) end
    end
    bump('output_tokens', tok)
    redis.call('HINCRBY', KEYS[4], ARGV[2], 1)
    redis.call('HINCRBY', KEYS[4], ARGV[2] .. '|' .. ARGV[3], 1)
    redis.call('HINCRBY', KEYS[5], ARGV[2], tok)
    redis.call('HINCRBY', KEYS[5], ARGV[2] .. '|' .. ARGV[3], tok)
    redis.call('HINCRBY', KEYS[6], 'rows', 1)
    redis.call('HINCRBY', KEYS[6], 'output_tokens', tok)
  end
end
if counted > 0 and KEYS[9] then
  local last = tonumber(redis.call('HGET', KEYS[9], 'last_row_at') or '0')
  if tonumber(ARGV[5]) > last then redis.call('HSET', KEYS[9], 'last_row_at', ARGV[5]) end
end
return counted
