"""The Redis tier's budget index, as Lua scripts run by `RedisStore` (with `redis.max_bytes`).

Keys (one hash tag, so one node of a cluster holds all three): KEYS[1] a sorted set of our block
keys scored by last use (the server's microseconds), KEYS[2] a hash key -> size, KEYS[3] the byte
counter. `ADD` (ARGV: budget, ttl in us, then key, size pairs) records new blocks, forgets those
past the ttl and pops the oldest while the counter is over the budget: it returns the victims
(the caller DELs them: keys we wrote). `TOUCH` (ARGV: 'touch' or 'forget', then keys) moves keys to
now, or drops them from the index (a block found missing, expired, deleted, or not verifiable).
"""

ADD = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local function forget(m)
  local s = redis.call('HGET', KEYS[2], m)
  if s then redis.call('HDEL', KEYS[2], m); redis.call('DECRBY', KEYS[3], s) end
  redis.call('ZREM', KEYS[1], m)
end
for i = 3, #ARGV, 2 do
  if redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[i + 1]) == 1 then
    redis.call('INCRBY', KEYS[3], ARGV[i + 1])
  end
  redis.call('ZADD', KEYS[1], now, ARGV[i])
end
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - ttl, 'LIMIT', 0, 4096)) do
    forget(m)
  end
end
local victims = {}
local budget = tonumber(ARGV[1])
while tonumber(redis.call('GET', KEYS[3]) or '0') > budget do
  local pop = redis.call('ZRANGE', KEYS[1], 0, 0)
  if #pop == 0 then break end
  forget(pop[1])
  victims[#victims + 1] = pop[1]
end
return victims
"""

TOUCH = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
for i = 2, #ARGV do
  if ARGV[1] == 'touch' then
    redis.call('ZADD', KEYS[1], 'XX', now, ARGV[i])
  else
    local s = redis.call('HGET', KEYS[2], ARGV[i])
    if s then redis.call('HDEL', KEYS[2], ARGV[i]); redis.call('DECRBY', KEYS[3], s) end
    redis.call('ZREM', KEYS[1], ARGV[i])
  end
end
return 0
"""
